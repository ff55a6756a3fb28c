"""Checkpoint files that are data, never code: tensors in safetensors, everything else in JSON.

A worker's state (model, optimizer, scheduler, RNG) is a tree of dicts, lists, tuples,
numbers, strings and tensors. ``write_state`` splits it into two files under
``<checkpoint>/<role>/``:

    tensors.safetensors   every tensor, keyed by its path in the tree ("model/lm_head.weight",
                          "optimizer/state/lm_head.weight/exp_avg")
    state.json            the tree, each tensor replaced by {"__tensor__": key} and each tuple
                          by {"__tuple__": [...]}; plus the format tag

Neither format can run code when read (pickle, which ``torch.load`` uses, can: a checkpoint
from elsewhere could run any command on resume). ``read_state`` refuses, with a
``CheckpointError`` naming the file, anything that is not exactly what this module writes:
a file that resolves outside the run directory (``RUN`` of ``RUN/checkpoints/step_N``, else the
checkpoint directory itself: a symlinked file or step directory) or is not a regular file, a
truncated or malformed tensor file, JSON that is not the expected tree, tensors that the tree
does not reference or references that the file lacks, and model tensors whose names, shapes or
dtypes differ from the live model's. The checks read only the safetensors header, so every
rank can make them (and refuse together, instead of rank 0 alone raising while the others wait
in a collective); the tensor data is read only where asked for.

Checkpoints of older agentrl versions (``actor.pt``/``critic.pt``, pickles) are refused with
the command that converts them: ``agentrl checkpoint convert DIR`` (``torch.load`` with
``weights_only=True``, whose unpickler builds only tensors and plain containers).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from agentrl.errors import CheckpointError

__all__ = ["FORMAT", "write_state", "read_state", "expected_tensors", "read_json", "convert_legacy", "cli_main"]

FORMAT = "agentrl-checkpoint/1"
TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
MAX_JSON_BYTES = 256 * 2**20  # far above any real state.json (the RNG state and schedule)
_TENSOR, _TUPLE = "__tensor__", "__tuple__"

# torch dtype <-> the safetensors header's dtype names
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


# ----------------------------------------------------------------------------- write


def write_state(directory: str | Path, role: str, state: Mapping[str, Any]) -> Path:
    """Write ``state`` (a tree of containers, scalars and tensors) under ``directory/role``."""
    from safetensors.torch import save_file

    out = Path(directory) / role
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[tuple, str] = {}  # tied weights are stored once and referenced twice

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            alias = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
            if value.numel() and alias in aliases:
                return {_TENSOR: aliases[alias]}
            aliases[alias] = path
            tensors[path] = value.contiguous()
            return {_TENSOR: path}
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str) or key in (_TENSOR, _TUPLE):
                    raise CheckpointError(f"cannot save {role} state: key {key!r} at {path or '/'} (keys must be strings)")
            return {key: encode(v, f"{path}/{key}" if path else key) for key, v in value.items()}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise CheckpointError(f"cannot save {role} state: {type(value).__name__} at {path} is not data (tensor, number, string, container)")

    tree = encode(dict(state), "")
    save_file(tensors, str(out / TENSORS_FILE), metadata={"format": FORMAT})
    (out / STATE_FILE).write_text(json.dumps({"format": FORMAT, "role": role, "state": tree}))
    return out


# ----------------------------------------------------------------------------- read


def expected_tensors(model: torch.nn.Module) -> dict[str, TensorInfo]:
    """The full (unsharded) name -> shape/dtype of a model's state dict; works on FSDP2 modules,
    whose DTensors report the global shape. Local: no collective."""
    return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def read_state(
    directory: str | Path, role: str, *, expect_model: Mapping[str, TensorInfo] | None = None, load_tensors: bool = True
) -> dict[str, Any]:
    """The tree ``write_state`` wrote, after every check in the module docstring.

    ``expect_model``: the names, shapes and dtypes the ``model`` subtree must have exactly (and
    the optimizer's per-parameter tensors must have the parameter's shape or be scalars).
    ``load_tensors=False`` checks everything but leaves each tensor as ``None`` (ranks that do
    not hold the full state)."""
    base = Path(directory)
    root = base.parent.parent if base.parent.name == "checkpoints" else base  # the run directory
    folder = base / role
    if not folder.is_dir():
        legacy = base / f"{role}.pt"
        if legacy.exists():
            raise CheckpointError(
                f"{legacy} is a pickle checkpoint of an older agentrl: loading it could run code, so agentrl no longer "
                f"reads it. If you trust where it came from, convert it with `agentrl checkpoint convert {base}` "
                f"(it loads the file with torch.load(weights_only=True) and writes {role}/{TENSORS_FILE} + {role}/{STATE_FILE})"
            )
        raise CheckpointError(f"{base}: no {role} state ({folder} is missing)")
    state_path = _inside(root, folder / STATE_FILE)
    tensors_path = _inside(root, folder / TENSORS_FILE)
    doc = read_json(state_path, root=root)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("state"), dict):
        raise CheckpointError(f"{state_path}: not an {FORMAT} state file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    header = _tensor_header(tensors_path)
    referenced: set[str] = set()
    tree = _decode(doc["state"], header, referenced, state_path, "")
    unreferenced = sorted(set(header) - referenced)
    if unreferenced:
        raise CheckpointError(f"{tensors_path}: {len(unreferenced)} tensor(s) that {state_path} does not reference, e.g. {unreferenced[:3]}")
    if expect_model is not None:
        _check_model(tree, header, expect_model, tensors_path)
    if not load_tensors:
        return tree
    from safetensors.torch import load_file

    try:
        data = load_file(str(tensors_path))
    except Exception as exc:  # the header was sound; a failure here is a damaged file
        raise CheckpointError(f"{tensors_path}: cannot read the tensors: {exc}") from exc
    return _fill(tree, data)


def read_json(path: str | Path, *, root: str | Path) -> Any:
    """A JSON file of a checkpoint or run directory, refused if it resolves outside ``root``,
    is not a regular file, is larger than ``MAX_JSON_BYTES`` or is not JSON."""
    path = _inside(Path(root), Path(path))
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a state file may have")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc


def _inside(root: Path, path: Path) -> Path:
    """``path`` resolved, if it is a regular file within ``root`` (resolved): a symlink out of the
    run (to /etc/passwd, to another user's files) or a FIFO (which would block) is refused."""
    resolved, top = path.resolve(), root.resolve()
    if not resolved.is_relative_to(top):
        raise CheckpointError(f"{path} resolves to {resolved}, outside {top}, where a checkpoint's files must stay: refused")
    if not resolved.is_file():
        raise CheckpointError(f"{path}: missing or not a regular file")
    return resolved


def _tensor_header(path: Path) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes from the safetensors header; safetensors checks on open that the
    header is well formed and that the data it describes fills the file exactly (truncation)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an {FORMAT} tensor file")
            out = {}
            for key in handle.keys():
                piece = handle.get_slice(key)
                dtype = _ST_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{path}: tensor {key!r} has dtype {piece.get_dtype()}, not one agentrl saves")
                out[key] = TensorInfo(tuple(piece.get_shape()), dtype)
            return out
    except CheckpointError:
        raise
    except Exception as exc:  # SafetensorError: truncated, malformed header, overlapping data
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc}); the file is damaged or truncated") from exc


def _decode(node: Any, header: Mapping[str, TensorInfo], referenced: set[str], source: Path, path: str) -> Any:
    if isinstance(node, dict):
        if set(node) == {_TENSOR}:
            key = node[_TENSOR]
            if not isinstance(key, str) or key not in header:
                raise CheckpointError(f"{source}: {path or '/'} refers to tensor {key!r}, which the tensor file lacks")
            referenced.add(key)
            return _Ref(key)
        if set(node) == {_TUPLE}:
            if not isinstance(node[_TUPLE], list):
                raise CheckpointError(f"{source}: {path}: a tuple must hold a list")
            return tuple(_decode(v, header, referenced, source, f"{path}/{i}") for i, v in enumerate(node[_TUPLE]))
        return {k: _decode(v, header, referenced, source, f"{path}/{k}" if path else k) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v, header, referenced, source, f"{path}/{i}") for i, v in enumerate(node)]
    return node


@dataclass(frozen=True, slots=True)
class _Ref:
    key: str


def _fill(node: Any, data: Mapping[str, torch.Tensor] | None) -> Any:
    if isinstance(node, _Ref):
        return data[node.key] if data is not None else None
    if isinstance(node, dict):
        return {k: _fill(v, data) for k, v in node.items()}
    if isinstance(node, tuple):
        return tuple(_fill(v, data) for v in node)
    if isinstance(node, list):
        return [_fill(v, data) for v in node]
    return node


def _check_model(tree: dict, header: Mapping[str, TensorInfo], expect: Mapping[str, TensorInfo], path: Path) -> None:
    model = tree.get("model")
    if not isinstance(model, dict) or not all(isinstance(v, _Ref) for v in model.values()):
        raise CheckpointError(f"{path}: the model state must map parameter names to tensors")
    missing, unexpected = sorted(set(expect) - set(model)), sorted(set(model) - set(expect))
    if missing or unexpected:
        raise CheckpointError(f"{path}: model tensors do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, ref in model.items():
        found, want = header[ref.key], expect[name]
        if found.shape != want.shape:
            raise CheckpointError(f"{path}: {name} has shape {list(found.shape)}, the model's is {list(want.shape)}")
        if found.dtype != want.dtype:
            raise CheckpointError(f"{path}: {name} has dtype {found.dtype}, the model's is {want.dtype}")
    optimizer = tree.get("optimizer")
    per_param = optimizer.get("state") if isinstance(optimizer, dict) else None
    for name, entries in (per_param if isinstance(per_param, dict) else {}).items():
        if name not in expect or not isinstance(entries, dict):
            raise CheckpointError(f"{path}: optimizer state for {name!r}, which is not a parameter of the model")
        for field, ref in entries.items():
            if not isinstance(ref, _Ref):
                continue
            found = header[ref.key]
            if found.shape not in ((), expect[name].shape) or not found.dtype.is_floating_point:
                raise CheckpointError(
                    f"{path}: optimizer state {name}/{field} has shape {list(found.shape)} and dtype {found.dtype}; "
                    f"expected a float scalar or the parameter's shape {list(expect[name].shape)}"
                )


# ----------------------------------------------------------------------------- legacy pickles


def convert_legacy(directory: str | Path) -> list[Path]:
    """Rewrite ``actor.pt``/``critic.pt`` of an older checkpoint in this format. The pickles are
    read with ``weights_only=True``: torch's restricted unpickler, which builds tensors and plain
    containers only and refuses any other object (a payload that would run code)."""
    base = Path(directory)
    written = []
    for legacy in sorted(base.glob("*.pt")):
        role = legacy.stem
        try:
            state = torch.load(_inside(base, legacy), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(f"{legacy}: refused by torch.load(weights_only=True), so it is not plain data: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{legacy}: holds a {type(state).__name__}, not an agentrl worker state")
        if isinstance(state.get("rng"), torch.Tensor):
            state["rng"] = state["rng"].tolist()
        written.append(write_state(base, role, state))
    if not written:
        raise CheckpointError(f"{base}: no *.pt files to convert")
    return written


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl checkpoint", description="Checkpoint utilities.")
    sub = parser.add_subparsers(dest="action", required=True)
    convert = sub.add_parser("convert", help="rewrite an older agentrl checkpoint (actor.pt, critic.pt) as safetensors + JSON")
    convert.add_argument("directory", help="a checkpoint directory, e.g. RUN/checkpoints/step_10")
    args = parser.parse_args(argv)
    try:
        for folder in convert_legacy(args.directory):
            print(f"wrote {folder}")
    except CheckpointError as exc:
        print(f"agentrl checkpoint: {exc}", file=sys.stderr)
        return 1
    return 0

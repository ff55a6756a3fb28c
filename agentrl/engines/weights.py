"""Copying new weights into a live model: from a state dict or a checkpoint directory.

Weights are copied *into* the existing parameters (``copy_``) so the engine keeps its tensors,
its KV cache layout and any views onto them; a dtype change (a bf16 trainer feeding an fp32
engine) happens in the copy. Tied weights (``lm_head.weight`` sharing storage with
``model.embed_tokens.weight``) may arrive under either name or both: each distinct tensor is
written once. Every problem (unknown key, wrong shape, a parameter left without a value) is
reported at once, before anything is written, so a bad update never leaves a half-loaded model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file

__all__ = ["read_checkpoint", "copy_weights_into"]


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a transformers ``save_pretrained`` directory (safetensors, sharded or not; or .bin)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / name for name in shards]
    else:
        files = sorted(root.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(_load(file, lambda f: load_file(str(f))))
        return state
    bins = sorted(root.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for file in bins:
            state.update(_load(file, lambda f: torch.load(f, map_location="cpu", weights_only=True)))
        return state
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {root}")


def _load(file: Path, reader) -> dict[str, torch.Tensor]:
    """One weights file; a damaged file or a pickle that is not plain tensors (refused by
    ``weights_only=True``: a payload that would run code) is a ValueError naming the file, which
    the engine reports to the caller, instead of an unpickling error that would end its worker."""
    try:
        state = reader(file)
    except Exception as exc:
        raise ValueError(f"{file}: not a readable weights file of plain tensors: {str(exc)[:300]}") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{file}: not a mapping of names to tensors")
    return state


@torch.no_grad()
def copy_weights_into(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> int:
    """Copy ``state_dict`` into ``model`` in place; return the number of tensors written.

    Unknown keys and shape mismatches are errors. With ``strict`` every parameter and persistent
    buffer of the model must receive a value (directly or through a tied alias); without it a
    subset is fine (a bucket of a streamed update).
    """
    targets = model.state_dict(keep_vars=True)  # tied aliases appear under every name
    problems: list[str] = []
    for name, tensor in state_dict.items():
        target = targets.get(name)
        if target is None:
            problems.append(f"unknown key {name!r}")
        elif tuple(tensor.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
    given_storage = {targets[name].data_ptr() for name in state_dict if name in targets}
    missing = [name for name, target in targets.items() if strict and target.data_ptr() not in given_storage]
    if missing:
        problems.append(f"no value for {', '.join(missing[:8])}" + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if problems:
        raise ValueError("cannot load weights: " + "; ".join(problems))
    written: set[int] = set()
    for name, tensor in state_dict.items():
        target = targets[name]
        if target.data_ptr() in written:
            continue  # a tied alias already written under its other name
        target.copy_(tensor)
        written.add(target.data_ptr())
    return len(written)

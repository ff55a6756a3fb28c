"""Writing the policy as a transformers checkpoint straight from its state dict.

What an engine in another process reloads (SGLang's ``/update_weights_from_disk``, the built-in
engine's ``update_weights(path=...)``) and what ``agentrl train`` leaves behind: one
``model.safetensors`` with the tensors under the model's own (HF) names, beside the starting
checkpoint's ``config.json``, generation config and tokenizer files, copied as they are.

No model is built (not even on the meta device) and no second copy of the state is made: each
tensor is cast to the checkpoint's dtype (the ``dtype`` of its ``config.json``) only when it is
not in it already, and moved to the CPU only when it is not there, then written. The directory
appears whole or not at all: everything is written into a temporary sibling, flushed, and renamed
into place, so a reader never sees half a checkpoint (an older one it replaces is removed after
the rename). Nothing is fsynced: the checkpoint is for a reader on a live machine, and a crash
loses only a copy the next step writes again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Collection, Mapping

import torch

__all__ = ["write_hf_checkpoint", "checkpoint_dtype", "SIDE_FILES"]

# the files of the starting checkpoint that go beside the weights (the tokenizer's and the configs)
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(config: Mapping[str, object]) -> torch.dtype | None:
    """The dtype a transformers ``config.json`` declares (``dtype``, or the older ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype")
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"config.json: dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[str(name)]


def write_hf_checkpoint(state: Mapping[str, torch.Tensor], directory: str | Path, *, source: str | Path,
                        dtype: torch.dtype | None = None, expected: Collection[str] | None = None) -> Path:
    """Write ``state`` (HF names, tied duplicates already dropped) as a transformers checkpoint in
    ``directory``, with the config and tokenizer files of ``source`` (the checkpoint the policy
    started from); ``dtype`` defaults to the one ``source/config.json`` declares (else each
    tensor's own). ``expected``: the names the state must hold (a missing one is an error, before
    anything is written). Returns ``directory``."""
    from safetensors.torch import save_file

    source, final = Path(source), Path(directory)
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: the starting checkpoint has no config.json to write beside the weights")
    if not state:
        raise ValueError("write_hf_checkpoint: the state is empty")
    missing = [name for name in expected or () if name not in state]
    if missing:
        raise RuntimeError(f"write_hf_checkpoint: the policy state has no tensor for {', '.join(missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if dtype is None:
        dtype = checkpoint_dtype(json.loads(config_file.read_text()))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write_hf_checkpoint: {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous()  # no copy for a contiguous CPU tensor
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.writing-", dir=final.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        for name in SIDE_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, staging / name)
        _swap_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _swap_into_place(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``; an existing ``final`` is first renamed aside, then removed."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / final.name)
    os.rename(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

"""LoRA adapters on the actor through ``peft`` (``actor.lora.rank > 0``).

The adapters are added to the HF model before FSDP2 shards it; only their parameters require
grad, so the optimizer holds state for them alone. Checkpoints keep the wrapped model's full
state (frozen base + adapters) and the adapters' optimizer state, so a resume is exact. The
engine and the HF export get *merged* weights (``W + alpha/rank * B @ A``) under the base
model's own names: engines load a plain transformers checkpoint and need no adapter support.
"""

from __future__ import annotations

import torch

from agentrl.config.schema import LoraConfig

__all__ = ["apply_lora", "merged_state", "trainable_parameters"]

_PREFIX = "base_model.model."
_ADAPTER = "default"  # peft's name for the one adapter


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters (peft freezes every base parameter)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as error:  # an optional extra
        raise ImportError("actor.lora.rank > 0 needs peft: pip install 'agentrl[lora]'") from error
    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
        # ["all-linear"] (verl's default spelling) is peft's "all-linear": every linear layer but the output head
        target_modules="all-linear" if list(config.target_modules) == ["all-linear"] else list(config.target_modules), bias="none",
    )
    return get_peft_model(model, peft_config)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def merged_state(state: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in, from a (gathered, full) state dict
    of the peft-wrapped model. Pure arithmetic on CPU tensors: no second model is built."""
    if not state:  # ranks other than 0 hold nothing after a gather
        return {}
    scaling = config.alpha / config.rank
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key.removeprefix(_PREFIX)
        if ".base_layer." in name:
            module = key.rsplit(".base_layer.", 1)[0]
            if name.endswith(".weight"):
                a = state[f"{module}.lora_A.{_ADAPTER}.weight"].to(torch.float32)
                b = state[f"{module}.lora_B.{_ADAPTER}.weight"].to(torch.float32)
                value = (value.to(torch.float32) + scaling * (b @ a)).to(value.dtype)
            name = name.replace(".base_layer.", ".")
        merged[name] = value
    return merged

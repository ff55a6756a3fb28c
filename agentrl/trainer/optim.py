"""Optimizer and learning-rate schedule of one worker (actor, critic or SFT).

The schedule is a function of the optimizer step: linear warmup over ``lr_warmup_steps`` from
0 to ``lr``, then constant or a half cosine down to ``min_lr_ratio * lr`` at ``total_steps``.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from agentrl.config.schema import OptimConfig

__all__ = ["build_optimizer", "build_lr_scheduler", "lr_factor"]


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    if config.optimizer == "SGD":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    # The fused kernel: on CPU it is several times faster than the default per-parameter loop
    # and the multi-tensor (foreach) form (see docs/benchmarks.md).
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=True)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler {schedule!r}; expected constant or cosine")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``total_steps``: optimizer steps of the whole run (for the cosine decay)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            warmup_steps=config.lr_warmup_steps,
            total_steps=total_steps,
            schedule=config.lr_scheduler,
            min_lr_ratio=config.min_lr_ratio,
        ),
    )

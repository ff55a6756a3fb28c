"""Masked statistics over response tokens: means, variances and whitening over the entries where
the mask is 1, and the shape check every algorithm runs on its inputs.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_same_shape",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]

def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{name} {shape}" for name, shape in shapes.items()))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask == 1 (over everything, or along ``dim``); 0 where the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over mask == 1 (Bessel-corrected by default, as verl)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked entries (std with Bessel's correction, as verl)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean

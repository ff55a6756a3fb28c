"""KL between the policy and the reference: the estimators (k1, abs, k2, k3 under verl's names),
KL as a reward penalty or as the adaptive controller's measurement, and the fixed and adaptive
controllers of its coefficient.
"""

from __future__ import annotations

from typing import Literal

import torch

from agentrl.trainer.algorithms.masked import check_same_shape, masked_mean

__all__ = [
    "KLKind",
    "kl_penalty",
    "apply_kl_penalty",
    "kl_for_controller",
    "FixedKLController",
    "AdaptiveKLController",
]

KLKind = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]


_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def kl_penalty(
    logprob: torch.Tensor,  # (B, T) policy
    ref_logprob: torch.Tensor,  # (B, T) reference
    kind: str,
) -> torch.Tensor:  # (B, T)
    """Per-token estimate of KL(policy || reference), Schulman's estimators with verl's names:
    k1/kl = log p - log q, abs = |log p - log q|, k2/mse = (log p - log q)^2 / 2,
    k3/low_var_kl = q/p - log(q/p) - 1, clamped to [-10, 10] as verl does.
    As a reward penalty see ``apply_kl_penalty``; as a loss term use
    ``aggregate_loss(kl_penalty(...), response_mask, mode)``."""
    canonical = _KL_ALIASES.get(kind)
    if canonical is None:
        raise ValueError(f"unknown KL estimator {kind!r}; use one of {sorted(_KL_ALIASES)}")
    diff = logprob - ref_logprob
    if canonical == "k1":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "k2":
        return 0.5 * diff.square()
    log_ratio = (ref_logprob - logprob).clamp(-20, 20)  # keeps exp finite
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)


def apply_kl_penalty(
    token_rewards: torch.Tensor,  # (B, T)
    logprob: torch.Tensor,  # (B, T)
    ref_logprob: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:  # penalized rewards (B, T), current KL ()
    """KL as a reward penalty (verl's ``apply_kl_penalty``): rewards - kl_coef * KL on sampled
    tokens. The current KL is ``kl_for_controller``'s, the value the adaptive controller takes."""
    check_same_shape(
        token_rewards=token_rewards, logprob=logprob, ref_logprob=ref_logprob, response_mask=response_mask
    )
    kl = kl_penalty(logprob, ref_logprob, kind) * response_mask
    return token_rewards - kl_coef * kl, kl_for_controller(logprob, ref_logprob, response_mask, kind)


def kl_for_controller(
    old_logprobs: torch.Tensor,  # (B, T) the policy that sampled
    ref_logprobs: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    kind: str,
) -> torch.Tensor:  # ()
    """The KL that verl's adaptive controller is updated with (``apply_kl_penalty`` in its
    ray_trainer.py): each sequence's masked token mean of the configured estimator, averaged
    over the sequences - a sequence without sampled tokens counts as 0, as in verl. Update with
    ``controller.update(float(kl_for_controller(...)), n_steps=batch_size)``."""
    check_same_shape(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
    kl = kl_penalty(old_logprobs, ref_logprobs, kind) * response_mask
    return masked_mean(kl, response_mask, dim=-1).mean()


class FixedKLController:
    """A constant KL coefficient (``.value``)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """The proportional controller of Ziegler et al. (2019), as verl: after ``n_steps``
    samples, ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got target={target}, horizon={horizon}"
            )
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon

"""Recipes around the loss: rollout correction (truncated importance weights of the trainer's
logprobs against the engine's), DAPO's dynamic sampling and overlong reward shaping, and the
filter that leaves truncated responses out of the loss.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from agentrl.trainer.algorithms.masked import check_same_shape, masked_mean

__all__ = [
    "RolloutCorrectionLevel",
    "rollout_correction_weights",
    "dynamic_sampling_filter",
    "overlong_reward_penalty",
    "add_to_last_sampled_token",
    "overlong_filter_mask",
]

RolloutCorrectionLevel = Literal["token", "sequence"]


def rollout_correction_weights(
    old_logprobs: torch.Tensor,  # (B, T) the trainer's logprobs of the sampled tokens
    engine_logprobs: torch.Tensor,  # (B, T) the inference engine's logprobs of the same tokens
    response_mask: torch.Tensor,  # (B, T)
    level: str = "token",
    cap: float = 2.0,
    outlier_threshold: float | None = None,
    method: str = "tis",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # weights (B, T) detached, 0 off the mask; metrics
    """Truncated importance sampling for the gap between the engine that sampled and the trainer
    (verl's ``compute_rollout_correction_weights``): w = trainer prob / engine prob, per token
    (``token``) or one per sequence, the product of its token ratios (``sequence``), log ratios
    clamped to [-20, 20], then truncated at ``cap``. Multiply each token's policy loss by w.

    ``outlier_threshold`` (> 1) masks outliers, giving them weight 0: a token (``token``) or a
    whole sequence (``sequence``, judged on its geometric-mean token ratio) whose ratio lies
    outside [1/threshold, threshold] - a sampling bug or a numerically broken token, not a
    distribution gap to correct. They stay in the aggregation's denominator, so the loss keeps
    its normalisation across micro-batches.

    ``method="decoupled"`` (AReaL's decoupled PPO, token level only): ``old_logprobs`` are the
    proximal policy's (the trainer's recomputation at the consuming step) and the engine's the
    behaviour policy's; a token's weight is their ratio, and a token whose weight exceeds ``cap``
    gets weight 0 (masked, counted in masked_fraction) instead of being truncated.

    metrics: truncated_fraction (tokens whose weight was capped), masked_fraction (tokens masked
    as outliers), corrected_fraction (either), weight_mean (after correction); fractions are
    over sampled tokens."""
    check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, response_mask=response_mask)
    if cap <= 0:
        raise ValueError(f"rollout correction cap must be positive, got {cap}")
    if outlier_threshold is not None and outlier_threshold <= 1:
        raise ValueError(f"rollout correction outlier_threshold must be > 1, got {outlier_threshold}")
    if method not in ("tis", "decoupled"):
        raise ValueError(f"unknown rollout correction method {method!r}; use 'tis' or 'decoupled'")
    if method == "decoupled" and level != "token":
        raise ValueError(f"decoupled PPO weighs each token: level must be 'token', got {level!r}")
    log_ratio = (old_logprobs - engine_logprobs).detach() * response_mask  # (B, T)
    if level == "token":
        log_weight = log_ratio.clamp(-20.0, 20.0)
        outlier_stat = log_ratio
    elif level == "sequence":
        seq_sum = log_ratio.sum(-1, keepdim=True)  # (B, 1)
        log_weight = seq_sum.clamp(-20.0, 20.0).expand_as(log_ratio)
        outlier_stat = (seq_sum / response_mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown rollout correction level {level!r}; use one of {list(get_args(RolloutCorrectionLevel))}")
    raw = torch.exp(log_weight) * response_mask
    truncated = (raw > cap) & (response_mask > 0)
    weights = raw.clamp(max=cap)
    masked = torch.zeros_like(truncated)
    if method == "decoupled":  # over the cap: masked, not truncated
        masked, truncated = truncated, torch.zeros_like(truncated)
        weights = torch.where(masked, torch.zeros_like(raw), raw)
    if outlier_threshold is not None:
        bound = math.log(outlier_threshold)
        masked = (outlier_stat.abs() > bound) & (response_mask > 0)
        weights = torch.where(masked, torch.zeros_like(weights), weights)
    metrics = {
        "truncated_fraction": masked_mean((truncated & ~masked).float(), response_mask),
        "masked_fraction": masked_mean(masked.float(), response_mask),
        "corrected_fraction": masked_mean((truncated | masked).float(), response_mask),
        "weight_mean": masked_mean(weights, response_mask),
    }
    return weights, metrics


def dynamic_sampling_filter(
    scores: torch.Tensor,  # (N,) each trajectory's score (DAPO: its outcome reward)
    group_ids: torch.Tensor,  # (N,) the prompt each trajectory answers
) -> tuple[torch.Tensor, dict[str, int]]:  # kept trajectory indices (M,) long, counts
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): drop every group whose
    scores are all equal (zero std: no advantage, no gradient). A group of one is kept, as verl
    keeps it. Returns the indices of the kept trajectories in their original order and
    ``{"groups_drawn", "groups_kept", "groups_dropped", "trajectories_kept"}``. The training loop
    draws further batches while fewer than ``train_batch_size`` groups are kept, at most
    ``filter_groups.max_num_gen_batches`` batches, then trains on the first
    ``train_batch_size`` kept groups."""
    check_same_shape(scores=scores, group_ids=group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    G = len(counts)
    zeros = torch.zeros(G, dtype=torch.float64, device=scores.device)
    x = scores.to(torch.float64)
    lo = zeros.clone().scatter_reduce(0, inverse, x, reduce="amin", include_self=False)
    hi = zeros.clone().scatter_reduce(0, inverse, x, reduce="amax", include_self=False)
    keep_group = (hi > lo) | (counts == 1)  # (G,)
    kept = keep_group[inverse].nonzero().flatten()
    n_kept = int(keep_group.sum())
    return kept, {"groups_drawn": G, "groups_kept": n_kept, "groups_dropped": G - n_kept,
                  "trajectories_kept": int(kept.numel())}


def overlong_reward_penalty(
    response_lengths: torch.Tensor,  # (B,) tokens of each response
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:  # (B,) <= 0, added to each trajectory's reward
    """DAPO's soft overlong punishment (verl's ``overlong_buffer``): 0 up to
    ``max_response_length - buffer_length`` tokens, then falling linearly to ``-penalty_factor``
    at ``max_response_length``: min(0, -(len - (L_max - L_cache)) / L_cache * factor)."""
    if not 0 < buffer_length < max_response_length:
        raise ValueError(
            f"overlong buffer length must be in (0, max_response_length={max_response_length}), got {buffer_length}"
        )
    expected = max_response_length - buffer_length
    exceed = response_lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_length * penalty_factor, max=0.0)


def add_to_last_sampled_token(
    token_rewards: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    rewards: torch.Tensor,  # (B,) e.g. overlong_reward_penalty(...)
) -> torch.Tensor:  # (B, T)
    """Add a per-trajectory reward where the trajectory reward sits: on the last sampled token
    of each row (a row without sampled tokens gets nothing)."""
    B, T = response_mask.shape
    if rewards.shape != (B,):
        raise ValueError(f"rewards {tuple(rewards.shape)} needs one entry per row of response_mask {tuple(response_mask.shape)}")
    positions = torch.arange(T, device=response_mask.device).expand(B, T)
    last = torch.where(response_mask > 0, positions, torch.full_like(positions, -1)).max(-1).values  # (B,)
    has = last >= 0
    added = torch.zeros_like(token_rewards)
    added[has, last[has]] = rewards[has].to(token_rewards.dtype)
    return token_rewards + added


def overlong_filter_mask(
    truncated: torch.Tensor,  # (B,) bool: the response hit the length limit
    response_mask: torch.Tensor,  # (B, T)
) -> torch.Tensor:  # (B, T)
    """DAPO's overlong filtering: a truncated response is left out of the loss (its mask is
    zeroed), since its reward judges an unfinished answer."""
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} needs one entry per row of response_mask {tuple(response_mask.shape)}")
    return response_mask * (~truncated.bool()).unsqueeze(-1).to(response_mask.dtype)

"""RL algorithms as pure tensor functions (no state but the KL controllers).

Conventions: response tensors are (B, T), right-padded. ``mask`` is the loss mask: 1 on tokens
the policy sampled, 0 on observed tokens inside the response (tool results, user turns) and on
padding. ``token_rewards`` (B, T) carry rewards on any token: each assistant turn's reward on
its last token, the trajectory reward on the last sampled token. ``group_ids`` (B,) says which
samples answer the same prompt. Everything is fp32.

Observed tokens are *transparent* to credit assignment: GAE and REINFORCE++ run their
recursions over sampled tokens only (an observation neither discounts nor bootstraps), and a
reward that sits on an observed token moves to the sampled token before it.

Turn-level credit for the critic-free estimators (``grpo``, ``drgrpo``): each assistant turn
k of a trajectory is credited with the discounted return from that turn on,

    G_k = sum_{j >= k} turn_gamma^(j - k) * r_j

where r_j is the reward of turn j (a tool's step reward, an interaction's turn score, and for
the last turn also the trajectory reward). The returns are then normalized within the group
over all turns of all its samples - each turn counted once, so trajectories with different
numbers of turns are compared on the same scale - ``(G - mean) / (std + eps)`` (Dr.GRPO: no
division), and every sampled token of turn k gets turn k's advantage. With one turn per
trajectory this is exactly GRPO on the trajectory reward.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "ESTIMATORS",
    "LossAggMode",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "aggregate_loss",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_turn_returns",
    "turn_level_advantages",
    "kl_penalty",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "ppo_policy_loss",
    "value_loss",
    "entropy_from_logits",
]

ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


# ---------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
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


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a (B, T) loss to a scalar.

    token-mean: every sampled token weighs the same; seq-mean-token-sum: sum over a sequence's
    tokens, mean over sequences; seq-mean-token-mean: mean over tokens, then over sequences.
    Sequences without any sampled token are left out of the sequence means.
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    has_tokens = (mask.sum(-1) > 0).float()  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = (loss * mask).sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


# ---------------------------------------------------------------------------- advantages


def _rewards_onto_sampled(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move rewards that sit on observed tokens to the last sampled token before them
    (a reward before any sampled token has nothing to credit and is dropped)."""
    out = token_rewards * mask
    stray = token_rewards * (1 - mask)
    if not stray.any():
        return out
    last = torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
    for t in range(mask.shape[1]):
        last = torch.where(mask[:, t] > 0, torch.full_like(last, t), last)
        rows = ((stray[:, t] != 0) & (last >= 0)).nonzero().squeeze(-1)
        out[rows, last[rows]] += stray[rows, t]
    return out


def compute_gae(
    token_rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over sampled tokens only; returns (advantages, returns), both 0 off the mask."""
    rewards = _rewards_onto_sampled(token_rewards, mask)
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        sampled = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(sampled, adv, torch.zeros_like(adv))
        next_adv = torch.where(sampled, adv, next_adv)
        next_value = torch.where(sampled, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def _group_stats(x: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None):
    """Per-element mean and std (unbiased; 1 for singleton groups) of x within its group."""
    valid = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.bool()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    mean = torch.zeros(len(groups), dtype=x.dtype, device=x.device)
    std = torch.ones(len(groups), dtype=x.dtype, device=x.device)
    for g in range(len(groups)):
        members = x[(inverse == g) & valid]
        if members.numel() > 0:
            mean[g] = members.mean()
        if members.numel() > 1:
            std[g] = members.std()
    return mean[inverse], std[inverse]


def compute_grpo_advantages(
    scores: torch.Tensor,  # (B,)
    group_ids: torch.Tensor,  # (B,)
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B,)
    """GRPO: each score relative to its group's mean, divided by the group's std unless
    ``norm_by_std`` is False (Dr.GRPO)."""
    mean, std = _group_stats(scores, group_ids)
    centered = scores - mean
    return centered / (std + eps) if norm_by_std else centered


def compute_rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:  # (B,) -> (B,)
    """RLOO: each score minus the mean of the *other* samples of its group (a lone sample keeps its score)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    n = counts[inverse].to(scores.dtype)
    others = (sums[inverse] - scores) / (n - 1).clamp(min=1)
    return torch.where(n > 1, scores - others, scores)


def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    gamma: float,
) -> torch.Tensor:  # (B, T)
    """REINFORCE++: discounted return-to-go over sampled tokens, whitened over the batch."""
    rewards = _rewards_onto_sampled(token_rewards, mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        sampled = mask[:, t] > 0
        running = torch.where(sampled, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(sampled, running, torch.zeros_like(running))
    return masked_whiten(returns, mask) * mask


def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
) -> torch.Tensor:  # (B, T)
    """REINFORCE++ with a baseline: score minus its group's mean, on every token, whitened."""
    mean, _ = _group_stats(scores, group_ids)
    per_token = (scores - mean).unsqueeze(-1) * mask
    return masked_whiten(per_token, mask) * mask


def compute_turn_returns(
    turn_rewards: torch.Tensor,  # (B, K) padded with 0 past num_turns
    num_turns: torch.Tensor,  # (B,)
    gamma: float,
) -> torch.Tensor:  # (B, K): G_k = sum_{j>=k} gamma^(j-k) r_j, 0 past num_turns
    B, K = turn_rewards.shape
    valid = torch.arange(K, device=turn_rewards.device).unsqueeze(0) < num_turns.unsqueeze(1)
    rewards = turn_rewards * valid
    returns = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for k in reversed(range(K)):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns * valid


def turn_level_advantages(
    turn_rewards: torch.Tensor,  # (B, K)
    num_turns: torch.Tensor,  # (B,)
    turn_ids: torch.Tensor,  # (B, T) assistant-turn index of each sampled token, -1 elsewhere
    mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B, T)
    """Per-turn returns normalized within each group over all its turns, broadcast to tokens."""
    B, K = turn_rewards.shape
    returns = compute_turn_returns(turn_rewards, num_turns, gamma)  # (B, K)
    valid = torch.arange(K, device=returns.device).unsqueeze(0) < num_turns.unsqueeze(1)  # (B, K)
    flat_groups = group_ids.unsqueeze(1).expand(B, K).reshape(-1)
    mean, std = _group_stats(returns.reshape(-1), flat_groups, valid.reshape(-1))
    normalized = returns.reshape(-1) - mean
    if norm_by_std:
        normalized = normalized / (std + eps)
    normalized = (normalized.reshape(B, K) * valid).to(returns.dtype)
    if K == 0:
        return torch.zeros_like(mask)
    index = turn_ids.clamp(min=0)  # (B, T)
    per_token = torch.gather(normalized, 1, index)
    return per_token * (turn_ids >= 0) * mask


# ---------------------------------------------------------------------------- KL


_KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3)."""
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
    kl = (ref_logprob - logprob).clamp(-20, 20)  # k3 / low_var_kl, clamped as verl does
    return (torch.exp(kl) - kl - 1).clamp(-10, 10)


def apply_kl_penalty(
    token_rewards: torch.Tensor,  # (B, T)
    logprob: torch.Tensor,  # (B, T)
    ref_logprob: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty: rewards - kl_coef * KL on sampled tokens; returns (rewards, mean KL)."""
    kl = kl_penalty(logprob, ref_logprob, kind) * mask
    current = masked_mean(kl, mask, dim=-1).mean()
    return token_rewards - kl_coef * kl, current


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """The proportional controller of Ziegler et al. (2019): moves the coefficient so that the
    measured KL approaches ``target``; the error is clipped to ±20% per horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon


# ---------------------------------------------------------------------------- losses


def ppo_policy_loss(
    logprob: torch.Tensor,  # (B, T)
    old_logprob: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with separate low/high clip and dual clip for negative advantages."""
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual = torch.minimum(pessimistic, -advantages * clip_ratio_c)
    losses = torch.where(advantages < 0, dual, pessimistic)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "clipfrac_lower": masked_mean(((pessimistic > -advantages * clip_ratio_c) & (advantages < 0)).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return aggregate_loss(losses, mask, loss_agg_mode), metrics


def value_loss(
    values: torch.Tensor,  # (B, T) current predictions
    old_values: torch.Tensor,  # (B, T) predictions at rollout time
    returns: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old ± c) - R)^2)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), mask, loss_agg_mode)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).float(), mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> (...)
    """Entropy of softmax(logits), computed stably: logsumexp(z) - sum(softmax(z) * z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)

"""RL algorithms as pure tensor functions (no state but the KL controllers).

Where a function carries a verl name it computes verl's formula (verl/trainer/ppo/core_algos.py
and ``apply_kl_penalty`` in its ray_trainer.py at b178a3cd), pinned at 1e-5 by
tests/trainer/test_verl_parity.py; docs/algorithms.md lists every algorithm, its config keys
and its test, and the deliberate differences with their switches.

Conventions: response tensors are (B, T), right-padded. ``response_mask`` is the loss mask: 1
on tokens the policy sampled, 0 on observed tokens inside the response (tool results, user
turns) and on padding. ``token_rewards`` (B, T) carry rewards on any token: each assistant
turn's reward on its last token, the trajectory reward on the last sampled token.
``group_ids`` (B,) says which samples answer the same prompt. Everything is fp32.

GAE runs its recursion over sampled tokens only (an observation neither discounts nor
bootstraps, as in verl), and a reward that sits on an observed token or on padding moves to the
last sampled token before it (a reward before the first sampled token follows no action of the
policy and is dropped); the trainer's batches carry rewards on sampled tokens only, where this
is verl's GAE exactly.

Turn-level credit (``algorithm.grpo_turn_credit``; verl's outcome GRPO is the default): each
assistant turn k of a trajectory is credited with the discounted return from that turn on,

    G_k = sum_{j >= k} turn_gamma^(j - k) * r_j

where r_j is the reward of turn j (a tool's step reward, an interaction's turn score, and for
the last turn also the trajectory reward). The returns are then normalized within the group
over all turns of all its samples - each turn counted once, so trajectories with different
numbers of turns are compared on the same scale - ``(G - mean) / (std + eps)`` (Dr.GRPO: no
division), and every sampled token of turn k gets turn k's advantage. With one turn per
trajectory this is exactly GRPO on the trajectory reward.

Group statistics follow verl: std is unbiased, and a group holding a single score (or a single
turn return) has no baseline - it keeps its raw value (mean 0, std 1), as RLOO keeps a lone
sample's score.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

__all__ = [
    "AdvantageEstimator",
    "ESTIMATORS",
    "KLKind",
    "LossAggMode",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "aggregate_loss",
    "loss_denominator",
    "PolicyLoss",
    "POLICY_LOSSES",
    "RolloutCorrectionLevel",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_turn_returns",
    "estimate_advantages",
    "turn_level_advantages",
    "kl_penalty",
    "apply_kl_penalty",
    "kl_for_controller",
    "FixedKLController",
    "AdaptiveKLController",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "policy_loss",
    "value_loss",
    "rollout_correction_weights",
    "dynamic_sampling_filter",
    "overlong_reward_penalty",
    "overlong_filter_mask",
    "add_to_last_sampled_token",
    "entropy_from_logits",
    "entropy_from_logprobs",
]

# verl's names; "drgrpo" is grpo without the division by the group's std
AdvantageEstimator = Literal["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
# verl's ``actor.policy_loss.loss_mode`` names
PolicyLoss = Literal["vanilla", "gspo", "cispo"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
RolloutCorrectionLevel = Literal["token", "sequence"]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{name} {shape}" for name, shape in shapes.items()))


# ---------------------------------------------------------------------------- masked statistics


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


def aggregate_loss(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    mode: str = "token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:  # ()
    """Reduce a (B, T) loss to a scalar, as verl's ``agg_loss`` on one micro-batch and one rank.

    token-mean: every sampled token weighs the same; seq-mean-token-sum: sum over a sequence's
    tokens, mean over sequences; seq-mean-token-mean: mean over tokens, then over sequences;
    seq-mean-token-sum-norm (Dr.GRPO): token sums *summed* over sequences (verl divides by no
    sequence count) and divided by the constant ``norm_length`` (verl's ``loss_scale_factor``;
    verl's default is the padded width T, which here changes with trimming, so it must be
    given). Sequences without any sampled token are left out of the sequence means.
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    per_seq_sum = (loss * mask).sum(-1)  # (B,)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                f"loss_agg_mode 'seq-mean-token-sum-norm' needs a positive norm_length, got {norm_length!r}"
            )
        return per_seq_sum.sum() / norm_length
    has_tokens = (mask.sum(-1) > 0).to(loss.dtype)  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = per_seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = per_seq_sum / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {list(get_args(LossAggMode))}")
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def loss_denominator(mask: torch.Tensor, mode: str) -> float:  # mask (B, T)
    """What ``aggregate_loss`` divides this batch's sum by, apart from constants: its sampled
    tokens (token-mean), its sequences with a sampled token (seq-mean-*), and 1 for
    seq-mean-token-sum-norm, a plain sum. A micro-batch's loss times
    ``loss_denominator(micro) / loss_denominator(whole)`` summed over the micro-batches is the
    whole batch's loss, however it is split."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "seq-mean-token-sum-norm":
        return 1.0
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((mask.sum(-1) > 0).sum())
    raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {list(get_args(LossAggMode))}")


# ---------------------------------------------------------------------------- advantages


def _rewards_onto_sampled(
    token_rewards: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
) -> torch.Tensor:  # (B, T), zero off the mask
    """Move rewards that sit on observed tokens or padding to the last sampled token before them
    (a reward before the first sampled token follows no action and is dropped)."""
    B, T = response_mask.shape
    sampled = response_mask > 0
    positions = torch.arange(T, device=response_mask.device).expand(B, T)
    # index of the last sampled token at or before each position, -1 before the first one
    last_sampled = torch.where(sampled, positions, torch.full_like(positions, -1)).cummax(dim=1).values
    stray = torch.where(sampled | (last_sampled < 0), torch.zeros_like(token_rewards), token_rewards)
    kept = torch.where(sampled, token_rewards, torch.zeros_like(token_rewards))
    return kept.scatter_add(1, last_sampled.clamp(min=0), stray)


def compute_gae(
    token_rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T) critic values; only read on sampled tokens
    response_mask: torch.Tensor,  # (B, T)
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # advantages (B, T), returns (B, T); both 0 off the mask
    """GAE whose recursion runs over sampled tokens only: the next value of a sampled token is
    the value at the next *sampled* token (0 after the last one), observations are skipped.
    Returns = raw advantages + values on sampled tokens; the advantages are then whitened over
    the response mask of the whole batch, as verl's ``compute_gae_advantage_return`` does
    (``whiten=False``: the raw recursion)."""
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    rewards = _rewards_onto_sampled(token_rewards, response_mask)
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        sampled = response_mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(sampled, adv, torch.zeros_like(adv))
        next_adv = torch.where(sampled, adv, next_adv)
        next_value = torch.where(sampled, values[:, t], next_value)
    sampled = response_mask > 0
    returns = torch.where(sampled, advantages + values, torch.zeros_like(advantages))  # no NaN from padding values
    if whiten:
        advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, returns


def _group_mean_std(
    x: torch.Tensor,  # (N,)
    group_ids: torch.Tensor,  # (N,)
    valid: torch.Tensor | None = None,  # (N,) bool: entries that count
) -> tuple[torch.Tensor, torch.Tensor]:  # per-entry mean (N,), std (N,) of its group's valid entries
    """Unbiased std; a group with fewer than two valid entries has no baseline: mean 0, std 1."""
    valid = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.bool()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    weight = valid.to(x.dtype)
    x = torch.where(valid, x, torch.zeros_like(x))
    zeros = torch.zeros(num_groups, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, inverse, weight)
    mean = zeros.index_add(0, inverse, x) / count.clamp(min=1)
    squares = zeros.index_add(0, inverse, (x - mean[inverse]).square() * weight)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    lone = count < 2
    mean = torch.where(lone, torch.zeros_like(mean), mean)
    std = torch.where(lone, torch.ones_like(std), std)
    return mean[inverse], std[inverse]


def compute_grpo_advantages(
    scores: torch.Tensor,  # (B,)
    group_ids: torch.Tensor,  # (B,)
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B,)
    """GRPO: each score minus its group's mean, divided by (the group's std + eps) unless
    ``norm_by_std`` is False (Dr.GRPO). A sample alone in its group keeps its score."""
    _check_same_shape(scores=scores, group_ids=group_ids)
    mean, std = _group_mean_std(scores, group_ids)
    centered = scores - mean
    return centered / (std + eps) if norm_by_std else centered


def compute_rloo_advantages(
    scores: torch.Tensor,  # (B,)
    group_ids: torch.Tensor,  # (B,)
) -> torch.Tensor:  # (B,)
    """RLOO: each score minus the mean of the *other* samples of its group (a lone sample keeps its score)."""
    _check_same_shape(scores=scores, group_ids=group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    n = counts[inverse].to(scores.dtype)
    others = (sums[inverse] - scores) / (n - 1).clamp(min=1)
    return torch.where(n > 1, scores - others, scores)


def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    gamma: float,
    reset_at_observations: bool = True,
) -> torch.Tensor:  # (B, T)
    """REINFORCE++: discounted return-to-go, whitened over all sampled tokens of the batch; 0 off
    the mask.

    ``reset_at_observations`` (verl's ``compute_reinforce_plus_plus_outcome_advantage``, the
    default): the running return restarts at every token outside the response mask, so a
    sampled token sees only the rewards up to the next observation (or padding), rewards stay
    where they are. False (agentrl's multi-turn credit): observations are transparent, the
    return runs through them to every earlier turn, and a reward on an observed token moves to
    the sampled token before it."""
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    if reset_at_observations:
        for t in reversed(range(token_rewards.shape[1])):
            running = token_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * response_mask[:, t]
    else:
        rewards = _rewards_onto_sampled(token_rewards, response_mask)
        for t in reversed(range(rewards.shape[1])):
            sampled = response_mask[:, t] > 0
            running = torch.where(sampled, rewards[:, t] + gamma * running, running)
            returns[:, t] = torch.where(sampled, running, torch.zeros_like(running))
    return masked_whiten(returns, response_mask) * response_mask


def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor,  # (B,) per-sequence score (token_rewards.sum(-1))
    response_mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
) -> torch.Tensor:  # (B, T)
    """REINFORCE++ with a baseline: score minus its group's mean (a lone sample keeps its
    score), broadcast to every sampled token, then whitened over the batch."""
    _check_same_shape(scores=scores, group_ids=group_ids)
    mean, _ = _group_mean_std(scores, group_ids)
    per_token = (scores - mean).unsqueeze(-1) * response_mask
    return masked_whiten(per_token, response_mask) * response_mask


def compute_turn_returns(
    turn_rewards: torch.Tensor,  # (B, K) reward of assistant turn k, padded past num_turns
    num_turns: torch.Tensor,  # (B,) long
    gamma: float,
) -> torch.Tensor:  # (B, K): G_k = sum_{j>=k} gamma^(j-k) r_j, 0 past num_turns
    B, K = turn_rewards.shape
    valid = torch.arange(K, device=turn_rewards.device).unsqueeze(0) < num_turns.unsqueeze(1)  # (B, K)
    rewards = torch.where(valid, turn_rewards, torch.zeros_like(turn_rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for k in reversed(range(K)):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns * valid


def turn_level_advantages(
    turn_rewards: torch.Tensor,  # (B, K) reward of assistant turn k (trajectory reward added to the last)
    num_turns: torch.Tensor,  # (B,) long: assistant turns of each trajectory
    turn_ids: torch.Tensor,  # (B, T) long: assistant-turn index of each response token, -1 elsewhere
    response_mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # (B, T)
    """Per-turn returns (``compute_turn_returns``) normalized within each group over all the
    group's turns, each turn once; token t of turn k gets turn k's advantage, 0 off the mask."""
    B, K = turn_rewards.shape
    _check_same_shape(turn_ids=turn_ids, response_mask=response_mask)
    if num_turns.shape != (B,) or group_ids.shape != (B,) or turn_ids.shape[0] != B:
        raise ValueError(
            f"turn_rewards {tuple(turn_rewards.shape)} needs num_turns and group_ids of shape ({B},) and turn_ids with "
            f"{B} rows; got {tuple(num_turns.shape)}, {tuple(group_ids.shape)}, {tuple(turn_ids.shape)}"
        )
    too_many = (num_turns > K).nonzero()
    if too_many.numel():
        row = int(too_many[0])
        raise ValueError(f"row {row}: num_turns is {int(num_turns[row])} but turn_rewards holds {K} turns")
    beyond = (turn_ids >= num_turns.unsqueeze(1)).any(1).nonzero()
    if beyond.numel():
        row = int(beyond[0])
        reached, count = int(turn_ids[row].max()), int(num_turns[row])
        raise ValueError(f"row {row}: turn_ids reach turn {reached} but num_turns is {count}")
    if K == 0:
        return torch.zeros_like(response_mask)
    returns = compute_turn_returns(turn_rewards, num_turns, gamma)  # (B, K)
    valid = torch.arange(K, device=returns.device).unsqueeze(0) < num_turns.unsqueeze(1)  # (B, K)
    flat_groups = group_ids.unsqueeze(1).expand(B, K).reshape(-1)  # (B*K,)
    mean, std = _group_mean_std(returns.reshape(-1), flat_groups, valid.reshape(-1))
    normalized = returns.reshape(-1) - mean
    if norm_by_std:
        normalized = normalized / (std + eps)
    normalized = normalized.reshape(B, K) * valid  # (B, K)
    per_token = torch.gather(normalized, 1, turn_ids.clamp(min=0))  # (B, T)
    return per_token * (turn_ids >= 0) * response_mask


def estimate_advantages(
    estimator: str,
    *,
    token_rewards: torch.Tensor,  # (B, T) with the KL penalty already applied when it is in the reward
    response_mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    rpp_reset_at_observations: bool = True,
    grpo_turn_credit: bool = False,
    turn_gamma: float = 1.0,
    values: torch.Tensor | None = None,  # (B, T), gae only
    turn_rewards: torch.Tensor | None = None,  # (B, K), grpo_turn_credit only
    num_turns: torch.Tensor | None = None,  # (B,)
    turn_ids: torch.Tensor | None = None,  # (B, T)
) -> tuple[torch.Tensor, torch.Tensor]:  # advantages (B, T), returns (B, T)
    """One entry point for every estimator, with verl's semantics by default (the trainer's
    ``compute_advantages`` calls it with the ``algorithm`` section's values). Returns are the
    GAE returns for ``gae`` and the advantages for the critic-free estimators (verl returns
    the same tensor twice there, REINFORCE++ aside, whose returns no critic reads)."""
    scores = token_rewards.sum(-1)  # (B,)
    if estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs the critic's values")
        return compute_gae(token_rewards, values, response_mask, gamma, lam)
    if estimator in ("grpo", "drgrpo"):
        norm = estimator == "grpo" and norm_adv_by_std_in_grpo
        if grpo_turn_credit:
            if turn_rewards is None or num_turns is None or turn_ids is None:
                raise ValueError("algorithm.grpo_turn_credit needs turn_rewards, num_turns and turn_ids")
            advantages = turn_level_advantages(
                turn_rewards, num_turns, turn_ids, response_mask, group_ids, gamma=turn_gamma, norm_by_std=norm
            )
        else:
            advantages = compute_grpo_advantages(scores, group_ids, norm_by_std=norm).unsqueeze(1) * response_mask
    elif estimator == "rloo":
        advantages = compute_rloo_advantages(scores, group_ids).unsqueeze(1) * response_mask
    elif estimator == "reinforce_plus_plus":
        advantages = compute_reinforce_pp_advantages(token_rewards, response_mask, gamma, rpp_reset_at_observations)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = compute_reinforce_pp_baseline_advantages(scores, response_mask, group_ids)
    else:
        raise ValueError(f"unknown adv_estimator {estimator!r}; use one of {list(ESTIMATORS)}")
    return advantages, advantages


# ---------------------------------------------------------------------------- KL


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
    _check_same_shape(
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
    _check_same_shape(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
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


# ---------------------------------------------------------------------------- losses


def ppo_policy_loss(
    logprob: torch.Tensor,  # (B, T) current policy
    old_logprob: torch.Tensor,  # (B, T) policy that sampled
    advantages: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,  # (B, T) detached, see rollout_correction_weights
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # loss (), metrics of () tensors
    """PPO's clipped surrogate (verl's ``compute_policy_loss_vanilla``), ratio clipped to
    [1 - low, 1 + high] (DAPO's clip-higher when high > low), with dual clip for negative
    advantages: their loss is at most -A * clip_ratio_c (Ye et al., 2020). Each token's loss is
    multiplied by its rollout-correction weight when given.

    metrics: clipfrac (tokens where clipping raised the loss), clipfrac_lower (tokens bounded
    by the dual clip), ppo_kl (mean of old_logprob - logprob)."""
    _check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(pessimistic, dual_bound), pessimistic)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "clipfrac_lower": masked_mean(((pessimistic > dual_bound) & (advantages < 0)).float(), response_mask),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return aggregate_loss(losses, response_mask, loss_agg_mode, norm_length), metrics


def gspo_policy_loss(
    logprob: torch.Tensor,  # (B, T) current policy
    old_logprob: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    rollout_is_weights: torch.Tensor | None = None,  # (B, T)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # loss (), metrics of () tensors
    """GSPO (Zheng et al., 2025; verl's ``compute_policy_loss_gspo``): one importance ratio per
    sequence, the geometric mean of its token ratios s_i = exp(mean_t log(p/p_old)), clipped to
    [1 - low, 1 + high]. Each token carries s_i with the gradient of its own logprob:
    log s_i,t = sg(log s_i) + log p_t - sg(log p_t), clamped above at 10 as verl. Always
    aggregated seq-mean-token-mean (the config requires that mode with this loss, so every
    term of the actor's loss and its normalisation across micro-batches agree)."""
    _check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
    log_ratio = logprob - old_logprob  # (B, T)
    lengths = response_mask.sum(-1).clamp(min=1)  # (B,)
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / lengths  # (B,)
    token_log_ratio = (logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(token_log_ratio)  # (B, T): s_i on every token, with d/dtheta of log p_t
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "clipfrac_lower": torch.zeros((), dtype=logprob.dtype, device=logprob.device),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return aggregate_loss(losses, response_mask, "seq-mean-token-mean"), metrics


def cispo_policy_loss(
    logprob: torch.Tensor,  # (B, T) current policy
    old_logprob: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,  # (B, T)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # loss (), metrics of () tensors
    """CISPO (MiniMax-M1, 2025; verl's ``compute_policy_loss_cispo``): REINFORCE weighted by the
    importance ratio clipped to [1 - low, 1 + high] *with its gradient stopped*, so no token's
    gradient is dropped by clipping: loss_t = -sg(clip(r_t)) * A_t * log p_t.
    clipfrac counts the tokens whose ratio was clipped."""
    _check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = -clipped_ratio.detach() * advantages * logprob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {
        "clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask),
        "clipfrac_lower": torch.zeros((), dtype=logprob.dtype, device=logprob.device),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return aggregate_loss(losses, response_mask, loss_agg_mode, norm_length), metrics


def policy_loss(
    kind: str,  # actor.policy_loss: vanilla | gspo | cispo
    logprob: torch.Tensor,  # (B, T)
    old_logprob: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss named by ``actor.policy_loss`` (verl's ``get_policy_loss_fn``)."""
    common = dict(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, rollout_is_weights=rollout_is_weights)
    if kind == "vanilla":
        return ppo_policy_loss(logprob, old_logprob, advantages, response_mask, clip_ratio_c=clip_ratio_c,
                               loss_agg_mode=loss_agg_mode, norm_length=norm_length, **common)
    if kind == "gspo":
        if loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(f"policy loss 'gspo' aggregates seq-mean-token-mean; loss_agg_mode is {loss_agg_mode!r}")
        return gspo_policy_loss(logprob, old_logprob, advantages, response_mask, **common)
    if kind == "cispo":
        return cispo_policy_loss(logprob, old_logprob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
                                 norm_length=norm_length, **common)
    raise ValueError(f"unknown policy loss {kind!r}; use one of {list(POLICY_LOSSES)}")


def value_loss(
    values: torch.Tensor,  # (B, T) current predictions
    old_values: torch.Tensor,  # (B, T) predictions at rollout time
    returns: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # loss (), {"vf_clipfrac": ()}
    """Clipped value loss (verl's ``compute_value_loss``):
    0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2). The clip is a clamp, so a
    prediction inside the range is left exactly as it is and ``vf_clipfrac`` counts only the
    tokens whose clipped error is really larger."""
    _check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, norm_length)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask)}


# ---------------------------------------------------------------------------- recipes


def rollout_correction_weights(
    old_logprobs: torch.Tensor,  # (B, T) the trainer's logprobs of the sampled tokens
    engine_logprobs: torch.Tensor,  # (B, T) the inference engine's logprobs of the same tokens
    response_mask: torch.Tensor,  # (B, T)
    level: str = "token",
    cap: float = 2.0,
    outlier_threshold: float | None = None,
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

    metrics: truncated_fraction (tokens whose weight was capped), masked_fraction (tokens masked
    as outliers), corrected_fraction (either), weight_mean (after correction); fractions are
    over sampled tokens."""
    _check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, response_mask=response_mask)
    if cap <= 0:
        raise ValueError(f"rollout correction cap must be positive, got {cap}")
    if outlier_threshold is not None and outlier_threshold <= 1:
        raise ValueError(f"rollout correction outlier_threshold must be > 1, got {outlier_threshold}")
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
    _check_same_shape(scores=scores, group_ids=group_ids)
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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:  # (B, T, V) -> (B, T); any leading dims
    """Entropy of softmax(logits): -sum(p * log p) with log p from log_softmax, which subtracts
    the max logit first. (verl's logsumexp(z) - sum(p * z) cancels two numbers of the size of the
    logits: 2e-4 off at logits near 1e4, 7e-6 near 200; this form stays within 1e-7.) Gradients
    stay finite where p underflows to 0, unlike an entr(p) formulation."""
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:  # (..., V) log_softmax output -> (...)
    """Entropy from log-probabilities already computed (the trainer's logprob gather reuses them)."""
    return -(logp.exp() * logp).sum(-1)

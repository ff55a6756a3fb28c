"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (and its baseline variant),
turn-level credit, and ``estimate_advantages``, which picks one by ``algorithm.adv_estimator``.

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

from typing import Literal, get_args

import torch

from agentrl.trainer.algorithms.masked import check_same_shape, masked_whiten

__all__ = [
    "AdvantageEstimator",
    "ESTIMATORS",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_turn_returns",
    "turn_level_advantages",
    "estimate_advantages",
]

# verl's names; "drgrpo" is grpo without the division by the group's std
AdvantageEstimator = Literal["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)


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
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
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
    check_same_shape(scores=scores, group_ids=group_ids)
    mean, std = _group_mean_std(scores, group_ids)
    centered = scores - mean
    return centered / (std + eps) if norm_by_std else centered


def compute_rloo_advantages(
    scores: torch.Tensor,  # (B,)
    group_ids: torch.Tensor,  # (B,)
) -> torch.Tensor:  # (B,)
    """RLOO: each score minus the mean of the *other* samples of its group (a lone sample keeps its score)."""
    check_same_shape(scores=scores, group_ids=group_ids)
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
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
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
    check_same_shape(scores=scores, group_ids=group_ids)
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
    check_same_shape(turn_ids=turn_ids, response_mask=response_mask)
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

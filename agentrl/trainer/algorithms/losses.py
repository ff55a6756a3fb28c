"""Losses: aggregating a per-token loss into a scalar (verl's ``loss_agg_mode``) and the
denominator that splits it over micro-batches and ranks, the policy losses (PPO's clipped
objective, GSPO, CISPO), the clipped value loss, and the entropy of the policy's distribution.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from agentrl.trainer.algorithms.masked import check_same_shape, masked_mean

__all__ = [
    "LossAggMode",
    "PolicyLoss",
    "POLICY_LOSSES",
    "aggregate_loss",
    "loss_denominator",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
    "entropy_from_logprobs",
]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# verl's ``actor.policy_loss.loss_mode`` names
PolicyLoss = Literal["vanilla", "gspo", "cispo"]


POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)


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
    check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns).square()
    clipped = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, norm_length)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:  # (B, T, V) -> (B, T); any leading dims
    """Entropy of softmax(logits): -sum(p * log p) with log p from log_softmax, which subtracts
    the max logit first. (verl's logsumexp(z) - sum(p * z) cancels two numbers of the size of the
    logits: 2e-4 off at logits near 1e4, 7e-6 near 200; this form stays within 1e-7.) Gradients
    stay finite where p underflows to 0, unlike an entr(p) formulation."""
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:  # (..., V) log_softmax output -> (...)
    """Entropy from log-probabilities already computed (the trainer's logprob gather reuses them)."""
    return -(logp.exp() * logp).sum(-1)

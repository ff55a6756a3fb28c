"""agentrl's algorithms against verl's formulas at 1e-5 in fp32.

The expected values come from a transcription of verl's code written here, independently of
agentrl's: verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py and
``apply_kl_penalty`` in verl/trainer/ppo/ray_trainer.py at commit b178a3cd (each ``verl_*``
function names the function it follows, and keeps its loops and its dict-of-lists grouping).
The batches are seeded and random: varied lengths, empty rows, multi-turn masks (sampled runs
separated by observed runs), groups of one and groups whose rewards are all equal.

Where agentrl leaves a value 0 off the response mask, verl may leave anything there (its GAE
carries the running advantage through observations and padding); those entries weigh nothing in
any loss, so the comparison is on the mask and agentrl's zeros off it are asserted separately.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from agentrl.trainer.algorithms.advantages import compute_gae, compute_reinforce_pp_advantages, estimate_advantages
from agentrl.trainer.algorithms.kl import AdaptiveKLController, apply_kl_penalty, kl_for_controller, kl_penalty
from agentrl.trainer.algorithms.losses import aggregate_loss, entropy_from_logits, policy_loss, value_loss
from agentrl.trainer.rank import _loss_scale, mini_batch_denominator

SEEDS = range(6)
TOL = dict(atol=1e-5, rtol=1e-5)
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ---------------------------------------------------------------------------- verl, transcribed


def verl_masked_sum(values, mask, axis=None):  # torch_functional.masked_sum
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(axis) if axis is not None else (valid * mask).sum()


def verl_masked_mean(values, mask, axis=None):  # torch_functional.masked_mean
    s = verl_masked_sum(values, mask, axis)
    return s / ((mask.sum(axis) if axis is not None else mask.sum()) + 1e-8)


def verl_masked_var(values, mask):  # torch_functional.masked_var, unbiased
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return variance * (n / (n - 1))


def verl_masked_whiten(values, mask):  # torch_functional.masked_whiten, shift_mean=True
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, reversed_advantages = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, response_mask), returns


def verl_compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True,
                                        epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(len(scores)):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(len(scores)):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    return verl_masked_whiten(returns, response_mask) * response_mask


def verl_compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(len(scores)):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return verl_masked_whiten(scores, response_mask) * response_mask


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def verl_apply_kl_penalty(token_level_scores, old_log_probs, ref_log_prob, response_mask, beta, kl_penalty):
    """ray_trainer.apply_kl_penalty: (token_level_rewards, current_kl for kl_ctrl.update)."""
    kld = verl_kl_penalty_forward(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    current_kl = torch.mean(verl_masked_mean(kld, response_mask, axis=-1), dim=0).item()
    return token_level_scores - beta * kld, current_kl


class VerlAdaptiveKLController:  # core_algos.AdaptiveKLController
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):  # core_algos.agg_loss, one rank
    if loss_agg_mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        return torch.sum(seq_losses) / (loss_scale_factor or loss_mask.shape[-1])
    raise ValueError(loss_agg_mode)


def verl_compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high,
                                     clip_ratio_c, loss_agg_mode, loss_scale_factor=None, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, {"clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "clipfrac_lower": pg_clipfrac_lower}


def verl_compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    return loss, {"clipfrac": verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
                  "ppo_kl": verl_masked_mean(-negative_approx_kl, response_mask)}


def verl_compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high,
                                   loss_agg_mode):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, {"clipfrac": verl_masked_mean((ratio != clipped_ratio).float(), response_mask),
                  "ppo_kl": verl_masked_mean(-negative_approx_kl, response_mask)}


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode,
                            loss_scale_factor=None):
    # torch_functional.clip_by_value: max(min(x, hi), lo)
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * verl_agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode, loss_scale_factor)
    return vf_loss, verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)


def verl_entropy_from_logits(logits):  # torch_functional.entropy_from_logits
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


# ---------------------------------------------------------------------------- random batches


def random_batch(seed: int, B: int = 12, T: int = 10) -> dict[str, torch.Tensor]:
    """Rows of varied lengths: single-turn, multi-turn (sampled runs between observed runs) and
    empty ones; groups of sizes 4, 3, 2 (all-equal scores), 1, 1 and ..., all with the same
    prompt-level structure verl's uid grouping sees."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for b in range(B):
        kind = b % 4
        length = int(torch.randint(2, T + 1, (1,), generator=g))
        if kind == 3 and b in (3, 11):  # two empty rows
            continue
        mask[b, :length] = 1.0
        if kind in (1, 2) and length >= 5:  # multi-turn: an observation run inside the response
            start = int(torch.randint(1, length - 2, (1,), generator=g))
            stop = min(length - 1, start + int(torch.randint(1, 3, (1,), generator=g)))
            mask[b, start:stop] = 0.0
    sampled = mask > 0
    # rewards on sampled tokens, as the trainer's batches carry them (collate): a turn reward
    # inside, the trajectory reward on the last sampled token
    rewards = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) < 0.3) * sampled
    last = torch.where(sampled, torch.arange(T).expand(B, T), torch.full((B, T), -1)).max(-1).values
    for b in range(B):
        if last[b] >= 0:
            rewards[b, last[b]] += float(torch.randint(0, 2, (1,), generator=g))
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 5])[:B]
    # group 2 (rows 7, 8): all-equal scores
    rewards[7:9] = 0.0
    for b in (7, 8):
        if last[b] >= 0:
            rewards[b, last[b]] = 1.0
    logprob = -torch.rand(B, T, generator=g) * 3
    return {
        "mask": mask,
        "rewards": rewards,
        "group_ids": group_ids,
        "values": torch.randn(B, T, generator=g),
        "old_values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "logprob": logprob,
        "old_logprob": logprob + torch.randn(B, T, generator=g) * 0.3,
        "ref_logprob": logprob + torch.randn(B, T, generator=g) * 0.5,
        "advantages": torch.randn(B, T, generator=g),
        "loss": torch.randn(B, T, generator=g),
    }


def on_mask(agentrl: torch.Tensor, verl: torch.Tensor, mask: torch.Tensor) -> None:
    assert_close(agentrl * mask, verl * mask, **TOL)
    assert torch.all(agentrl[mask == 0] == 0), "agentrl leaves 0 off the response mask"


def uid(group_ids: torch.Tensor) -> np.ndarray:
    return np.array([f"uid{int(g)}" for g in group_ids], dtype=object)


def test_the_random_batches_hold_the_cases_the_parity_needs():
    d = random_batch(0)
    mask = d["mask"]
    assert (mask.sum(-1) == 0).sum() == 2  # empty rows
    gaps = ((mask[:, 1:] - mask[:, :-1]) == 1).sum(-1)
    assert (gaps >= 1).any()  # a sampled run after an observed run: multi-turn
    counts = torch.bincount(d["group_ids"])
    assert (counts == 1).any()  # groups of one
    scores = d["rewards"].sum(-1)
    assert scores[7] == scores[8]  # an all-equal group
    assert len(set(mask.sum(-1).tolist())) >= 4  # varied lengths


# ---------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.7)])
def test_gae_is_verls_compute_gae_advantage_return(seed, gamma, lam):
    d = random_batch(seed)
    adv, ret = compute_gae(d["rewards"], d["values"], d["mask"], gamma, lam)
    want_adv, want_ret = verl_compute_gae_advantage_return(d["rewards"], d["values"], d["mask"], gamma, lam)
    on_mask(adv, want_adv, d["mask"])
    on_mask(ret, want_ret, d["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_is_verls_compute_grpo_outcome_advantage(seed, norm):
    d = random_batch(seed)
    want = verl_compute_grpo_outcome_advantage(d["rewards"].clone(), d["mask"], uid(d["group_ids"]), norm)
    for estimator in ("grpo", "drgrpo"):
        if estimator == "drgrpo" and norm:
            continue
        adv, ret = estimate_advantages(estimator, token_rewards=d["rewards"], response_mask=d["mask"],
                                            group_ids=d["group_ids"], norm_adv_by_std_in_grpo=norm)
        on_mask(adv, want, d["mask"])
        assert_close(ret, adv)
    if norm:
        assert torch.all(want[7:9] == 0)  # the all-equal group


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_is_verls_compute_rloo_outcome_advantage(seed):
    d = random_batch(seed)
    adv, _ = estimate_advantages("rloo", token_rewards=d["rewards"], response_mask=d["mask"], group_ids=d["group_ids"])
    on_mask(adv, verl_compute_rloo_outcome_advantage(d["rewards"].clone(), d["mask"], uid(d["group_ids"])), d["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_is_verls_compute_reinforce_plus_plus_outcome_advantage(seed, gamma):
    d = random_batch(seed)
    want = verl_compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"], gamma)
    adv, _ = estimate_advantages("reinforce_plus_plus", token_rewards=d["rewards"], response_mask=d["mask"],
                                      group_ids=d["group_ids"], gamma=gamma)
    on_mask(adv, want, d["mask"])
    # verl's reset is the default: rewards anywhere (observations, padding) are taken as verl takes them
    anywhere = torch.randn(d["rewards"].shape, generator=torch.Generator().manual_seed(seed))
    on_mask(compute_reinforce_pp_advantages(anywhere, d["mask"], gamma),
            verl_compute_reinforce_plus_plus_outcome_advantage(anywhere, d["mask"], gamma), d["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_is_verls(seed):
    d = random_batch(seed)
    adv, _ = estimate_advantages("reinforce_plus_plus_baseline", token_rewards=d["rewards"],
                                      response_mask=d["mask"], group_ids=d["group_ids"])
    want = verl_compute_reinforce_plus_plus_baseline_outcome_advantage(d["rewards"].clone(), d["mask"], uid(d["group_ids"]))
    on_mask(adv, want, d["mask"])


def test_the_deliberate_differences_are_switches_and_differ_from_verl_on_multi_turn_rows():
    d = random_batch(0)
    multi = ((d["mask"][:, 1:] - d["mask"][:, :-1]) == 1).any(-1)
    verl = verl_compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"], 1.0)
    through, _ = estimate_advantages("reinforce_plus_plus", token_rewards=d["rewards"], response_mask=d["mask"],
                                          group_ids=d["group_ids"], rpp_reset_at_observations=False)
    assert not torch.allclose(through[multi] * d["mask"][multi], verl[multi] * d["mask"][multi], atol=1e-3)


# ---------------------------------------------------------------------------- KL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty_and_reward_penalty_are_verls(seed, kind):
    d = random_batch(seed)
    assert_close(kl_penalty(d["logprob"], d["ref_logprob"], kind),
                 verl_kl_penalty_forward(d["logprob"], d["ref_logprob"], kind), **TOL)
    rewards, current = apply_kl_penalty(d["rewards"], d["old_logprob"], d["ref_logprob"], d["mask"], 0.05, kind)
    want_rewards, want_current = verl_apply_kl_penalty(d["rewards"], d["old_logprob"], d["ref_logprob"], d["mask"], 0.05, kind)
    assert_close(rewards, want_rewards, **TOL)
    assert_close(float(current), want_current, **TOL)
    assert_close(float(kl_for_controller(d["old_logprob"], d["ref_logprob"], d["mask"], kind)), want_current, **TOL)


def test_kl_for_controller_is_the_mean_of_sequence_means_issue_example():
    # kind kl, old [[0,0],[0,0]], ref [[-1,0],[0,0]], mask [[1,0],[1,1]]: sequences 1 and 0 -> 0.5
    # (one token mean over the batch would be 1/3)
    old, ref, mask = torch.zeros(2, 2), torch.tensor([[-1.0, 0], [0, 0]]), torch.tensor([[1.0, 0], [1, 1]])
    assert_close(kl_for_controller(old, ref, mask, "kl"), torch.tensor(0.5))


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
def test_adaptive_controller_fed_kl_for_controller_follows_verl_over_steps(kind):
    ours = AdaptiveKLController(0.05, target=0.02, horizon=100)
    theirs = VerlAdaptiveKLController(0.05, target_kl=0.02, horizon=100)
    for step in range(8):
        d = random_batch(step)
        scale = 0.05 * (step + 1)  # the policy drifts from the reference: the error crosses the clip
        ref = d["old_logprob"] + torch.randn(d["mask"].shape, generator=torch.Generator().manual_seed(99 + step)) * scale
        _, want_current = verl_apply_kl_penalty(d["rewards"], d["old_logprob"], ref, d["mask"], theirs.value, kind)
        theirs.update(want_current, n_steps=len(d["mask"]))
        ours.update(float(kl_for_controller(d["old_logprob"], ref, d["mask"], kind)), n_steps=len(d["mask"]))
        assert_close(ours.value, float(theirs.value), atol=1e-9, rtol=1e-6)


# ---------------------------------------------------------------------------- losses


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_is_verls_agg_loss_on_one_micro_batch(seed, mode):
    d = random_batch(seed)
    T = d["mask"].shape[-1]
    got = aggregate_loss(d["loss"], d["mask"], mode, norm_length=T)
    assert_close(got, verl_agg_loss(d["loss"], d["mask"], mode), **TOL)
    assert_close(aggregate_loss(d["loss"], d["mask"], mode, norm_length=512),
                 verl_agg_loss(d["loss"], d["mask"], mode, loss_scale_factor=512), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_vanilla_policy_loss_is_verls_compute_policy_loss_vanilla(seed, mode, clip):
    d = random_batch(seed)
    weights = torch.rand(d["mask"].shape, generator=torch.Generator().manual_seed(seed)) * 2
    for w in (None, weights):
        loss, m = policy_loss("vanilla", d["logprob"], d["old_logprob"], d["advantages"], d["mask"],
                                   clip_ratio_low=clip[0], clip_ratio_high=clip[1], clip_ratio_c=3.0,
                                   loss_agg_mode=mode, norm_length=64, rollout_is_weights=w)
        want, wm = verl_compute_policy_loss_vanilla(d["old_logprob"], d["logprob"], d["advantages"], d["mask"],
                                                   clip[0], clip[1], 3.0, mode, 64, w)
        assert_close(loss, want, **TOL)
        for key in ("clipfrac", "clipfrac_lower", "ppo_kl"):
            assert_close(m[key], wm[key], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_policy_loss_and_its_gradient_are_verls(seed):
    d = random_batch(seed)
    d["logprob"] = d["old_logprob"] + torch.randn(d["mask"].shape, generator=torch.Generator().manual_seed(seed)) * 1e-3
    lp1 = d["logprob"].clone().requires_grad_(True)
    lp2 = d["logprob"].clone().requires_grad_(True)
    loss, m = policy_loss("gspo", lp1, d["old_logprob"], d["advantages"], d["mask"], clip_ratio_low=3e-4,
                               clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    want, wm = verl_compute_policy_loss_gspo(d["old_logprob"], lp2, d["advantages"], d["mask"], 3e-4, 4e-4)
    assert_close(loss, want, **TOL)
    assert_close(m["clipfrac"], wm["clipfrac"], **TOL)
    assert 0 < float(m["clipfrac"]) < 1  # the sequence ratios straddle the clip
    loss.backward()
    want.backward()
    assert_close(lp1.grad, lp2.grad, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_policy_loss_and_its_gradient_are_verls(seed, mode):
    d = random_batch(seed)
    lp1 = d["logprob"].clone().requires_grad_(True)
    lp2 = d["logprob"].clone().requires_grad_(True)
    loss, m = policy_loss("cispo", lp1, d["old_logprob"], d["advantages"], d["mask"], clip_ratio_low=0.2,
                               clip_ratio_high=0.28, loss_agg_mode=mode)
    want, wm = verl_compute_policy_loss_cispo(d["old_logprob"], lp2, d["advantages"], d["mask"], 0.2, 0.28, mode)
    assert_close(loss, want, **TOL)
    assert_close(m["clipfrac"], wm["clipfrac"], **TOL)
    loss.backward()
    want.backward()
    assert_close(lp1.grad, lp2.grad, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_and_vf_clipfrac_are_verls_compute_value_loss(seed, mode):
    d = random_batch(seed)
    values = d["old_values"] + d["values"] * 0.4  # some inside the clip range, some outside
    loss, m = value_loss(values, d["old_values"], d["returns"], d["mask"], 0.5, mode, norm_length=64)
    want, want_clipfrac = verl_compute_value_loss(values, d["returns"], d["old_values"], d["mask"], 0.5, mode, 64)
    assert_close(loss, want, **TOL)
    assert_close(m["vf_clipfrac"], want_clipfrac, **TOL)


def test_vf_clipfrac_does_not_count_tokens_inside_the_clip_range():
    # old + (v - old).clamp(-c, c) is 0.11984152 here, not v = 0.11984151: an unclipped token
    # whose "clipped" error came out larger counted as clipped before the fix
    v, old, ret = torch.tensor([[0.11984150856733322]]), torch.tensor([[0.2732088267803192]]), torch.tensor([[-1.532461166381836]])
    assert (old + (v - old).clamp(-0.5, 0.5) - ret) ** 2 > (v - ret) ** 2  # the old formula's artefact
    _, m = value_loss(v, old, ret, torch.ones(1, 1), cliprange_value=0.5)
    assert m["vf_clipfrac"] == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_is_verls_entropy_from_logits_at_moderate_logits(seed):
    logits = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(seed)) * 5
    assert_close(entropy_from_logits(logits), verl_entropy_from_logits(logits), **TOL)


# ---------------------------------------------------------------------------- across micro-batches and ranks


def split_rows(B: int, sizes: list[int]) -> list[list[int]]:
    rows, start = [], 0
    for size in sizes:
        rows.append(list(range(start, start + size)))
        start += size
    assert start == B
    return rows


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_scaled_micro_batch_losses_sum_to_the_whole_mini_batch_loss(seed, mode, world_size):
    """The workers' normalisation: each rank scales each micro-batch's aggregated loss by
    ``_loss_scale`` and FSDP averages the ranks' gradients (a 1/world_size), so the step's loss
    is sum_ranks sum_micro scale * loss / world_size. It must equal verl's agg_loss of the whole
    mini-batch on one rank, whatever the split (unequal micro-batches, an empty row alone)."""
    d = random_batch(seed)
    loss, mask = d["loss"], d["mask"]
    whole = verl_agg_loss(loss, mask, mode, loss_scale_factor=64)
    denominator = mini_batch_denominator(mask, mode)
    # ranks get unequal shares, each split into unequal micro-batches; row 3 (empty) is alone
    per_rank = {1: [[5, 3, 1, 3]], 2: [[2, 1, 1], [4, 3, 1]]}[world_size]
    parts = split_rows(len(mask), [size for rank in per_rank for size in rank])
    total = torch.tensor(0.0)
    for rows in parts:
        micro_loss = aggregate_loss(loss[rows], mask[rows], mode, norm_length=64)
        total = total + micro_loss * _loss_scale(mask[rows], mode, denominator, world_size) / world_size
    assert_close(total, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy", ["vanilla", "gspo", "cispo"])
def test_policy_loss_gradients_accumulated_over_micro_batches_equal_the_whole_batch(seed, policy):
    d = random_batch(seed)
    mode = "seq-mean-token-mean" if policy == "gspo" else "seq-mean-token-sum-norm"
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, norm_length=64)
    whole_lp = d["logprob"].clone().requires_grad_(True)
    policy_loss(policy, whole_lp, d["old_logprob"], d["advantages"], d["mask"], **kwargs)[0].backward()
    split_lp = d["logprob"].clone().requires_grad_(True)
    denominator = mini_batch_denominator(d["mask"], mode)
    for rows in split_rows(len(d["mask"]), [4, 1, 5, 2]):
        loss, _ = policy_loss(policy, split_lp[rows], d["old_logprob"][rows], d["advantages"][rows],
                                   d["mask"][rows], **kwargs)
        (loss * _loss_scale(d["mask"][rows], mode, denominator, 1)).backward()
    assert_close(split_lp.grad, whole_lp.grad, atol=1e-6, rtol=1e-6)

"""Every algorithm function against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from torch.testing import assert_close

from agentrl.trainer.algorithms.advantages import ESTIMATORS, compute_gae, compute_grpo_advantages, compute_reinforce_pp_advantages, compute_reinforce_pp_baseline_advantages, compute_rloo_advantages, compute_turn_returns, turn_level_advantages
from agentrl.trainer.algorithms.kl import AdaptiveKLController, FixedKLController, KLKind, apply_kl_penalty, kl_penalty
from agentrl.trainer.algorithms.losses import LossAggMode, POLICY_LOSSES, aggregate_loss, entropy_from_logits, ppo_policy_loss, value_loss
from agentrl.trainer.algorithms.masked import masked_mean, masked_var, masked_whiten

T = torch.tensor


def test_gae_three_sampled_tokens_by_hand():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # delta2 = 1 - 0.7 = 0.3                       A2 = 0.3
    # delta1 = 0 + 0.9*0.7 - 0.6 = 0.03            A1 = 0.03 + 0.72*0.3 = 0.246
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04            A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = compute_gae(T([[0.0, 0, 1]]), T([[0.5, 0.6, 0.7]]), T([[1.0, 1, 1]]), gamma=0.9, lam=0.8, whiten=False)
    assert_close(adv, T([[0.21712, 0.246, 0.3]]))
    assert_close(ret, T([[0.71712, 0.846, 1.0]]))


def test_gae_skips_observation_tokens_and_padding():
    # tokens: s s o o s pad (o observed, values there are garbage and must be ignored)
    # sampled sequence is s0 s1 s4 with values 0.5 0.6 0.7: the same numbers as the 3-token case
    rewards = T([[0.0, 0, 0, 0, 1, 0]])
    values = T([[0.5, 0.6, 9.0, 9.0, 0.7, 9.0]])
    mask = T([[1.0, 1, 0, 0, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    assert_close(adv, T([[0.21712, 0.246, 0, 0, 0.3, 0]]))
    assert_close(ret, T([[0.71712, 0.846, 0, 0, 1.0, 0]]))


def test_gae_moves_a_reward_on_an_observed_token_to_the_sampled_token_before_it():
    mask = T([[1.0, 0, 1]])
    values = torch.zeros(1, 3)
    moved, _ = compute_gae(T([[0.0, 2.0, 0.0]]), values, mask, gamma=1.0, lam=1.0, whiten=False)
    placed, _ = compute_gae(T([[2.0, 0.0, 0.0]]), values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert_close(moved, placed)
    assert_close(moved, T([[2.0, 0, 0]]))


def test_gae_uses_turn_rewards_on_any_sampled_token():
    # gamma = lam = 1, zero values: the advantage is the sum of rewards from each token on
    adv, _ = compute_gae(T([[0.0, 0.5, 0, 0, 1.0]]), torch.zeros(1, 5), T([[1.0, 1, 0, 1, 1]]), 1.0, 1.0, whiten=False)
    assert_close(adv, T([[1.5, 1.5, 0, 1.0, 1.0]]))


def test_grpo_normalizes_within_each_group():
    scores = T([1.0, 0.0, 1.0, 1.0, 3.0, 5.0])
    groups = T([0, 0, 0, 0, 1, 1])
    # group 0: mean .75, std (unbiased) = sqrt(((.25^2)*3 + .75^2)/3) = 0.5
    # group 1: mean 4, std sqrt(2) -> (-1/sqrt2, 1/sqrt2)
    adv = compute_grpo_advantages(scores, groups, eps=0.0)
    s = 1 / math.sqrt(2)
    assert_close(adv, T([0.5, -1.5, 0.5, 0.5, -s, s]))


def test_drgrpo_does_not_divide_by_std():
    adv = compute_grpo_advantages(T([1.0, 0.0, 1.0, 1.0]), T([0, 0, 0, 0]), norm_by_std=False)
    assert_close(adv, T([0.25, -0.75, 0.25, 0.25]))


def test_grpo_group_of_identical_scores_gives_zero():
    assert_close(compute_grpo_advantages(T([1.0, 1.0]), T([0, 0])), T([0.0, 0.0]))


def test_rloo_subtracts_the_mean_of_the_others():
    # group 0: [1, 0, 2] -> 1 - 1 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5; group 1: a lone sample keeps 4
    adv = compute_rloo_advantages(T([1.0, 0.0, 2.0, 4.0]), T([0, 0, 0, 1]))
    assert_close(adv, T([0.0, -1.5, 1.5, 4.0]))


def test_gae_advantages_are_whitened_over_the_response_mask_as_verl():
    # issue 28's example: rewards [[0,1],[0,0]], values [[.5,0],[0,0]], gamma = lam = 1
    # raw A = [[1 - .5, 1], [0, 0]] = [[.5, 1], [0, 0]]; mean .375, squared deviations
    # .015625 + .390625 + .140625 * 2 = .6875, unbiased var .6875 / 3 = .229167, std .478714
    # -> [[.261, 1.306], [-.783, -.783]]; returns stay raw: A + V
    adv, ret = compute_gae(T([[0.0, 1], [0, 0]]), T([[0.5, 0], [0, 0]]), torch.ones(2, 2), gamma=1.0, lam=1.0)
    std = math.sqrt(0.6875 / 3)
    assert_close(adv, T([[0.125 / std, 0.625 / std], [-0.375 / std, -0.375 / std]]))
    assert_close(adv, T([[0.261, 1.306], [-0.783, -0.783]]), atol=1e-3, rtol=0)
    assert_close(ret, T([[1.0, 1.0], [0.0, 0.0]]))


def test_reinforce_pp_restarts_the_return_at_observations_as_verl():
    # gamma .5, one row [s s o s] rewards [0, 1, 0, 2]: verl resets the running return on the
    # observation, so t1 = 1, t0 = .5 * 1 = .5 (the reward 2 after it reaches no earlier token)
    rewards, mask = T([[0.0, 1, 0, 2]]), T([[1.0, 1, 0, 1]])
    adv = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    assert_close(adv, masked_whiten(T([[0.5, 1, 0, 2]]), mask) * mask)


def test_reinforce_pp_returns_to_go_then_whitened():
    # gamma .5, one row [s s o s] rewards [0, 1, 0, 2]:
    # return at t3 = 2, t1 = 1 + .5*2 = 2, t0 = 0 + .5*2 = 1   (the observation is transparent)
    rewards, mask = T([[0.0, 1, 0, 2]]), T([[1.0, 1, 0, 1]])
    adv = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5, reset_at_observations=False)
    returns = T([[1.0, 2, 0, 2]])
    assert_close(adv, masked_whiten(returns, mask) * mask)
    # whitened over {1, 2, 2}: mean 5/3, std (unbiased) sqrt(1/3)
    assert_close(adv[0, 0], T((1 - 5 / 3) / math.sqrt(1 / 3)), atol=1e-4, rtol=1e-4)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # group 0 [1, 0] mean .5 -> +.5 / -.5 on each sampled token; group 1 is a lone sample: keeps 3
    scores, groups = T([1.0, 0.0, 3.0]), T([0, 0, 1])
    mask = T([[1.0, 1], [1.0, 0], [1.0, 1]])
    adv = compute_reinforce_pp_baseline_advantages(scores, mask, groups)
    centered = T([[0.5, 0.5], [-0.5, 0.0], [3.0, 3.0]])
    assert_close(adv, masked_whiten(centered, mask) * mask)
    # whitened over the 5 sampled tokens {.5, .5, -.5, 3, 3}: mean 1.3,
    # squared deviations .64 + .64 + 3.24 + 2.89 + 2.89 = 10.3, unbiased var 10.3 / 4 = 2.575
    assert_close(adv[1, 0], T((-0.5 - 1.3) / math.sqrt(2.575)))


def test_turn_returns_are_discounted_sums_from_each_turn_on():
    # r = [1, 0, 2], gamma .5: G2 = 2, G1 = 0 + 1 = 1, G0 = 1 + .5 = 1.5; row 2 has one turn
    G = compute_turn_returns(T([[1.0, 0, 2], [3.0, 9, 9]]), T([3, 1]), gamma=0.5)
    assert_close(G, T([[1.5, 1.0, 2.0], [3.0, 0.0, 0.0]]))


def test_turn_level_credit_with_one_turn_is_exactly_grpo():
    scores = T([1.0, 0.0, 1.0, 0.5])
    groups = T([0, 0, 1, 1])
    turn_ids = T([[0, 0, -1], [0, -1, -1], [0, 0, 0], [-1, 0, 0]])
    mask = (turn_ids >= 0).float()
    adv = turn_level_advantages(scores.unsqueeze(1), T([1, 1, 1, 1]), turn_ids, mask, groups)
    expected = compute_grpo_advantages(scores, groups).unsqueeze(1) * mask
    assert_close(adv, expected)


def test_a_late_rewarded_turn_gets_a_larger_advantage_than_earlier_turns():
    # trajectory A: turns rewarded [0, 0, 1]; B: [0, 0]; gamma .5 -> G_A = [.25, .5, 1], G_B = [0, 0]
    turn_rewards = T([[0.0, 0, 1], [0.0, 0, 0]])
    num_turns = T([3, 2])
    turn_ids = T([[0, 0, -1, 1, -1, 2, 2], [0, -1, 1, 1, -1, -1, -1]])
    mask = (turn_ids >= 0).float()
    adv = turn_level_advantages(turn_rewards, num_turns, turn_ids, mask, T([0, 0]), gamma=0.5)
    a = adv[0]
    assert a[5] > a[3] > a[0]  # last turn > middle turn > first turn
    assert (a[mask[0] == 0] == 0).all()
    # normalized over the group's 5 turns {.25, .5, 1, 0, 0}: mean .35, unbiased std
    mean = 0.35
    std = math.sqrt(((0.25 - mean) ** 2 + (0.5 - mean) ** 2 + (1 - mean) ** 2 + 2 * mean**2) / 4)
    assert_close(a[5], T((1 - mean) / (std + 1e-6)))
    assert_close(adv[1, 0], T((0 - mean) / (std + 1e-6)))


def test_kl_estimators_by_hand():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    d = math.log(2)  # logp - ref
    assert_close(kl_penalty(logp, ref, "k1"), T([d]))
    assert_close(kl_penalty(logp, ref, "kl"), T([d]))
    assert_close(kl_penalty(ref, logp, "abs"), T([d]))
    assert_close(kl_penalty(logp, ref, "mse"), T([0.5 * d * d]))
    # k3: r = ref/p = 0.5 -> r - log r - 1 = 0.5 + log 2 - 1
    assert_close(kl_penalty(logp, ref, "low_var_kl"), T([0.5 + d - 1]))
    assert_close(kl_penalty(logp, ref, "k3"), T([0.5 + d - 1]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_low_var_kl_is_clamped():
    assert kl_penalty(T([0.0]), T([30.0]), "k3").item() == 10.0


def test_kl_reward_penalty_on_sampled_tokens_only():
    rewards, mask = T([[0.0, 1.0, 0.0]]), T([[1.0, 1.0, 0.0]])
    logp, ref = T([[0.1, 0.2, 5.0]]), T([[0.0, 0.0, 0.0]])
    new, kl = apply_kl_penalty(rewards, logp, ref, mask, kl_coef=0.5, kind="k1")
    assert_close(new, T([[-0.05, 0.9, 0.0]]))
    assert_close(kl, T(0.15))


def test_adaptive_kl_controller_moves_towards_the_target():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=1.0, horizon=100)
    ctl.update(current_kl=1.5, n_steps=10)  # error clipped to +0.2: 0.1 * (1 + 0.2*10/100) = 0.102
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.9, n_steps=10)  # error -0.1: 0.102 * (1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    fixed = FixedKLController(0.3)
    fixed.update(5.0, 10)
    assert fixed.value == 0.3


def test_ppo_clip_both_sides():
    # ratios e^{ln 1.5} = 1.5 (A=+1, clipped to 1.2) and 0.5 (A=-1, clipped to 0.8)
    old = torch.zeros(1, 2)
    logp = T([[math.log(1.5), math.log(0.5)]])
    adv, mask = T([[1.0, -1.0]]), torch.ones(1, 2)
    loss, m = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)
    # token 0: max(-1.5, -1.2) = -1.2 ; token 1: max(0.5, 0.8) = 0.8 ; mean = -0.2
    assert_close(loss, T(-0.2))
    assert_close(m["clipfrac"], T(1.0))


def test_ppo_asymmetric_clip_uses_the_high_bound_for_raising():
    loss, _ = ppo_policy_loss(T([[math.log(1.5)]]), torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1), 0.2, 0.28)
    assert_close(loss, T(-1.28))


def test_ppo_dual_clip_bounds_negative_advantages():
    # ratio 5 with A = -1: clipped surrogate max(5, 0.8... high clip 1.2) = 5, dual clip min(5, 3) = 3
    loss, m = ppo_policy_loss(T([[math.log(5.0)]]), torch.zeros(1, 1), T([[-1.0]]), torch.ones(1, 1), 0.2, 0.2, 3.0)
    assert_close(loss, T(3.0))
    assert_close(m["clipfrac_lower"], T(1.0))


def test_ppo_ignores_masked_tokens():
    loss, _ = ppo_policy_loss(T([[0.0, 9.0]]), torch.zeros(1, 2), T([[2.0, 5.0]]), T([[1.0, 0.0]]))
    assert_close(loss, T(-2.0))


def test_value_loss_clipped_by_hand():
    # v_old 0, v 1, R 2, clip .5: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 0.5 * 2.25
    loss, m = value_loss(T([[1.0]]), T([[0.0]]), T([[2.0]]), T([[1.0]]), cliprange_value=0.5)
    assert_close(loss, T(1.125))
    assert_close(m["vf_clipfrac"], T(1.0))


def test_aggregation_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert_close(aggregate_loss(loss, mask, "token-mean"), T(10 / 4))
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), T((6 + 4) / 2))
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), T((2 + 4) / 2))
    empty = T([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert_close(aggregate_loss(loss, empty, "seq-mean-token-mean"), T(4.0))  # empty rows left out
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate_loss(loss, mask, "token-sum")


def test_entropy_matches_a_direct_softmax_computation():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)) * 5
    p = torch.softmax(logits, -1)
    assert_close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1))
    assert_close(entropy_from_logits(T([[0.0, 0.0]])), T([math.log(2)]))
    logits.requires_grad_(True)
    entropy_from_logits(logits * 100).sum().backward()  # p underflows to 0 on many entries
    assert torch.isfinite(logits.grad).all()


def test_masked_mean_and_whiten():
    x, mask = T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0])
    assert_close(masked_mean(x, mask), T(2.0))
    w = masked_whiten(x, mask)
    assert_close(w[:3], T([-1.0, 0.0, 1.0]), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- edges and bad input


def test_gae_batch_rows_are_independent_and_a_reward_on_padding_reaches_the_last_sampled_token():
    # row 0: the 3-token case above; row 1: s s pad pad with the reward misplaced on padding (t3)
    # row 1, gamma .9 lam .8, values [.5, .5]: reward moves to t1:
    # delta1 = 1 - .5 = .5  A1 = .5 ; delta0 = .9*.5 - .5 = -.05  A0 = -.05 + .72*.5 = .31
    rewards = T([[0.0, 0, 1, 0], [0.0, 0, 0, 1]])
    values = T([[0.5, 0.6, 0.7, 3.0], [0.5, 0.5, float("nan"), float("nan")]])
    mask = T([[1.0, 1, 1, 0], [1.0, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    assert_close(adv, T([[0.21712, 0.246, 0.3, 0], [0.31, 0.5, 0, 0]]))
    assert_close(ret, T([[0.71712, 0.846, 1.0, 0], [0.81, 1.0, 0, 0]]))  # NaN values on padding stay out


def test_gae_discounts_only_across_sampled_tokens():
    # s o o s with gamma .5, lam 1, zero values, reward 1 on t3: A3 = 1, A0 = .5 (one step, not three)
    adv, _ = compute_gae(T([[0.0, 0, 0, 1]]), torch.zeros(1, 4), T([[1.0, 0, 0, 1]]), gamma=0.5, lam=1.0, whiten=False)
    assert_close(adv, T([[0.5, 0, 0, 1.0]]))


def test_a_reward_before_the_first_sampled_token_is_dropped():
    # no action of the policy precedes it, so no estimator can credit it
    adv = compute_reinforce_pp_advantages(T([[5.0, 0, 1], [0.0, 0, 3]]), T([[0.0, 1, 1], [1.0, 1, 1]]), gamma=1.0)
    returns = T([[0.0, 1, 1], [3.0, 3, 3]])
    assert_close(adv, masked_whiten(returns, T([[0.0, 1, 1], [1.0, 1, 1]])) * T([[0.0, 1, 1], [1.0, 1, 1]]))


def test_a_sample_alone_in_its_group_keeps_its_score_as_in_verl():
    # group 1 holds one sample: no baseline, mean 0, std 1 -> 3 / (1 + eps)
    assert_close(compute_grpo_advantages(T([1.0, 0.0, 3.0]), T([0, 0, 1]), eps=0.0), T([0.7071068, -0.7071068, 3.0]))
    assert_close(compute_grpo_advantages(T([3.0]), T([7]), norm_by_std=False), T([3.0]))


def test_drgrpo_turn_level_credit_by_hand():
    # gamma 1: A turns [1, 2] -> G = [3, 2]; B one turn [0] -> G = [0]; group mean 5/3, no division
    turn_rewards, num_turns = T([[1.0, 2.0], [0.0, 0.0]]), T([2, 1])
    turn_ids = T([[0, -1, 1], [0, 0, -1]])
    mask = (turn_ids >= 0).float()
    adv = turn_level_advantages(turn_rewards, num_turns, turn_ids, mask, T([4, 4]), gamma=1.0, norm_by_std=False)
    assert_close(adv, T([[3 - 5 / 3, 0, 2 - 5 / 3], [-5 / 3, -5 / 3, 0]]))


def test_turn_level_credit_normalizes_each_group_separately():
    # groups {row0, row1} and {row2, row3}, one turn each: exactly GRPO per group
    scores, groups = T([2.0, 0.0, 5.0, 1.0]), T([1, 1, 0, 0])
    turn_ids = torch.zeros(4, 2, dtype=torch.long)
    adv = turn_level_advantages(scores.unsqueeze(1), torch.ones(4, dtype=torch.long), turn_ids, torch.ones(4, 2), groups)
    s = 1 / math.sqrt(2) / (1 + 1e-6)
    assert_close(adv, T([[s, s], [-s, -s], [s, s], [-s, -s]]))


def test_turn_ids_beyond_num_turns_are_refused():
    with pytest.raises(ValueError, match="row 1: turn_ids reach turn 1 but num_turns is 1"):
        turn_level_advantages(T([[1.0, 0], [1.0, 0]]), T([2, 1]), T([[0, 1], [0, 1]]), torch.ones(2, 2), T([0, 0]))
    with pytest.raises(ValueError, match="row 0: num_turns is 3 but turn_rewards holds 2 turns"):
        turn_level_advantages(T([[1.0, 0]]), T([3]), T([[0, 1]]), torch.ones(1, 2), T([0]))


def test_shape_mismatches_name_the_tensors():
    with pytest.raises(ValueError, match=r"shape mismatch: token_rewards \(1, 3\), values \(1, 2\)"):
        compute_gae(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="shape mismatch: scores"):
        compute_grpo_advantages(torch.zeros(3), T([0, 0]))


def test_remaining_kl_aliases_and_k3_as_penalty():
    logp, ref = T([0.0]), T([math.log(2)])  # log p - log q = -log 2
    d = math.log(2)
    assert_close(kl_penalty(logp, ref, "abs"), T([d]))
    assert_close(kl_penalty(logp, ref, "k2"), T([0.5 * d * d]))
    # k3: q/p = 2 -> 2 - log 2 - 1
    assert_close(kl_penalty(logp, ref, "k3"), T([1 - d]))
    new, kl = apply_kl_penalty(T([[1.0, 0.0]]), T([[0.0, 0.0]]), T([[math.log(2), 0.0]]), T([[1.0, 1.0]]), 0.1, "low_var_kl")
    # token 0 penalized by .1 * (1 - log 2); token 1 has KL 0; current KL = mean over the 2 tokens
    assert_close(new, T([[1 - 0.1 * (1 - d), 0.0]]))
    assert_close(kl, T((1 - d) / 2))


def test_adaptive_kl_controller_error_is_clipped_below_too():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=10)
    ctl.update(current_kl=0.0, n_steps=5)  # error -1 clipped to -0.2: 0.2 * (1 - 0.2*5/10) = 0.18
    assert ctl.value == pytest.approx(0.18)
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_ppo_inside_the_trust_region_is_unclipped_and_metrics_by_hand():
    # ratios 1.1 (A=2, inside [0.8, 1.2]) and 1.5 (A=1, clipped to 1.2): losses -2.2 and -1.2
    logp = T([[math.log(1.1), math.log(1.5)]])
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 2), T([[2.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2)
    assert_close(loss, T(-1.7))
    assert_close(m["clipfrac"], T(0.5))
    assert_close(m["clipfrac_lower"], T(0.0))
    assert_close(m["ppo_kl"], T(-(math.log(1.1) + math.log(1.5)) / 2))


def test_dual_clip_leaves_positive_advantages_alone():
    # ratio 5 with A = +1: clipped at 1.2 -> -1.2; the dual clip bound (-3) does not apply
    loss, m = ppo_policy_loss(T([[math.log(5.0)]]), torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1), 0.2, 0.2, 3.0)
    assert_close(loss, T(-1.2))
    assert_close(m["clipfrac_lower"], T(0.0))
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_policy_loss(T([[0.0]]), T([[0.0]]), T([[1.0]]), T([[1.0]]), clip_ratio_c=1.0)


def test_ppo_loss_uses_the_aggregation_mode():
    # zero log-ratio: the loss per token is -A; rows A = [1, 3] and [5, pad]
    adv, mask = T([[1.0, 3.0], [5.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    zeros = torch.zeros(2, 2)
    assert_close(ppo_policy_loss(zeros, zeros, adv, mask, loss_agg_mode="token-mean")[0], T(-3.0))  # -(1+3+5)/3
    assert_close(ppo_policy_loss(zeros, zeros, adv, mask, loss_agg_mode="seq-mean-token-sum")[0], T(-4.5))  # -(4+5)/2
    assert_close(ppo_policy_loss(zeros, zeros, adv, mask, loss_agg_mode="seq-mean-token-mean")[0], T(-3.5))  # -(2+5)/2
    loss, _ = ppo_policy_loss(zeros, zeros, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=9)
    assert_close(loss, T(-1.0))  # -(4+5)/9: verl sums the sequences


def test_seq_mean_token_sum_norm_needs_a_constant_length():
    loss, mask = T([[1.0, 2.0], [4.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=4), T((3 + 4) / 4))
    # issue 28's example: ones 2x4, lengths 2 and 3, T = 4 -> verl (2 + 3) / 4 = 1.25
    ones, lengths = torch.ones(2, 4), T([[1.0, 1, 0, 0], [1.0, 1, 1, 0]])
    assert_close(aggregate_loss(ones, lengths, "seq-mean-token-sum-norm", norm_length=4), T(1.25))
    with pytest.raises(ValueError, match="needs a positive norm_length"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


def test_value_loss_keeps_the_unclipped_error_when_it_is_larger():
    # v_old 0, v 1, R 0, clip .5: unclipped (1-0)^2 = 1, clipped (.5-0)^2 = .25 -> 0.5 * 1; padding ignored
    loss, m = value_loss(T([[1.0, 7.0]]), T([[0.0, 0.0]]), T([[0.0, 0.0]]), T([[1.0, 0.0]]), cliprange_value=0.5)
    assert_close(loss, T(0.5))
    assert_close(m["vf_clipfrac"], T(0.0))


def test_entropy_is_exact_for_huge_logits():
    # one dominant logit: entropy 0; two equal huge logits: log 2 exactly (logsumexp(z) - sum(p z)
    # cancels 1e4 against 1e4 in fp32 and is 2e-4 off)
    assert_close(entropy_from_logits(T([[1e4, 0.0, -1e4]])), T([0.0]))
    assert_close(entropy_from_logits(T([[1e4, 1e4]])), T([math.log(2)]))


def test_masked_var_is_unbiased():
    # {1, 2, 3}: squared deviations 1 + 0 + 1 = 2, / (3 - 1) = 1; biased 2/3
    x, mask = T([1.0, 2.0, 3.0, 50.0]), T([1.0, 1.0, 1.0, 0.0])
    assert_close(masked_var(x, mask), T(1.0))
    assert_close(masked_var(x, mask, unbiased=False), T(2 / 3))


def test_config_choices_are_names_the_algorithms_accept():
    from agentrl.config.schema import ActorConfig, AlgorithmConfig

    def choices(model, field):
        return set(get_args(model.model_fields[field].annotation))

    assert choices(AlgorithmConfig, "adv_estimator") == set(ESTIMATORS)
    assert choices(AlgorithmConfig, "kl_penalty") == set(get_args(KLKind))
    assert choices(ActorConfig, "kl_loss_type") == set(get_args(KLKind))
    assert choices(ActorConfig, "loss_agg_mode") == set(get_args(LossAggMode))
    assert choices(ActorConfig, "policy_loss") == set(POLICY_LOSSES)
    for kind in get_args(KLKind):
        kl_penalty(T([0.0]), T([0.0]), kind)  # each accepted

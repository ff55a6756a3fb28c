"""Every algorithm function against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from agentrl.trainer.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    compute_turn_returns,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    turn_level_advantages,
    value_loss,
)

T = torch.tensor


def test_gae_three_sampled_tokens_by_hand():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # delta2 = 1 - 0.7 = 0.3                       A2 = 0.3
    # delta1 = 0 + 0.9*0.7 - 0.6 = 0.03            A1 = 0.03 + 0.72*0.3 = 0.246
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04            A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = compute_gae(T([[0.0, 0, 1]]), T([[0.5, 0.6, 0.7]]), T([[1.0, 1, 1]]), gamma=0.9, lam=0.8)
    assert_close(adv, T([[0.21712, 0.246, 0.3]]))
    assert_close(ret, T([[0.71712, 0.846, 1.0]]))


def test_gae_skips_observation_tokens_and_padding():
    # tokens: s s o o s pad (o observed, values there are garbage and must be ignored)
    # sampled sequence is s0 s1 s4 with values 0.5 0.6 0.7: the same numbers as the 3-token case
    rewards = T([[0.0, 0, 0, 0, 1, 0]])
    values = T([[0.5, 0.6, 9.0, 9.0, 0.7, 9.0]])
    mask = T([[1.0, 1, 0, 0, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(adv, T([[0.21712, 0.246, 0, 0, 0.3, 0]]))
    assert_close(ret, T([[0.71712, 0.846, 0, 0, 1.0, 0]]))


def test_gae_moves_a_reward_on_an_observed_token_to_the_sampled_token_before_it():
    mask = T([[1.0, 0, 1]])
    values = torch.zeros(1, 3)
    moved, _ = compute_gae(T([[0.0, 2.0, 0.0]]), values, mask, gamma=1.0, lam=1.0)
    placed, _ = compute_gae(T([[2.0, 0.0, 0.0]]), values, mask, gamma=1.0, lam=1.0)
    assert_close(moved, placed)
    assert_close(moved, T([[2.0, 0, 0]]))


def test_gae_uses_turn_rewards_on_any_sampled_token():
    # gamma = lam = 1, zero values: the advantage is the sum of rewards from each token on
    adv, _ = compute_gae(T([[0.0, 0.5, 0, 0, 1.0]]), torch.zeros(1, 5), T([[1.0, 1, 0, 1, 1]]), 1.0, 1.0)
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


def test_reinforce_pp_returns_to_go_then_whitened():
    # gamma .5, one row [s s o s] rewards [0, 1, 0, 2]:
    # return at t3 = 2, t1 = 1 + .5*2 = 2, t0 = 0 + .5*2 = 1   (the observation is transparent)
    rewards, mask = T([[0.0, 1, 0, 2]]), T([[1.0, 1, 0, 1]])
    adv = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    returns = T([[1.0, 2, 0, 2]])
    assert_close(adv, masked_whiten(returns, mask) * mask)
    # whitened over {1, 2, 2}: mean 5/3, std (unbiased) sqrt(1/3)
    assert_close(adv[0, 0], T((1 - 5 / 3) / math.sqrt(1 / 3)), atol=1e-4, rtol=1e-4)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    scores, groups = T([1.0, 0.0, 3.0]), T([0, 0, 1])
    mask = T([[1.0, 1], [1.0, 0], [1.0, 1]])
    adv = compute_reinforce_pp_baseline_advantages(scores, mask, groups)
    centered = T([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]])
    assert_close(adv, masked_whiten(centered, mask) * mask)


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


def test_masked_mean_and_whiten():
    x, mask = T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0])
    assert_close(masked_mean(x, mask), T(2.0))
    w = masked_whiten(x, mask)
    assert_close(w[:3], T([-1.0, 0.0, 1.0]), atol=1e-6, rtol=1e-6)

"""The recipes' math (DAPO, GSPO, CISPO, Dr.GRPO, rollout correction) against values computed by
hand (the arithmetic is in the comments), and their config groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.trainer.algorithms.advantages import estimate_advantages, turn_level_advantages
from agentrl.trainer.algorithms.losses import cispo_policy_loss, gspo_policy_loss, policy_loss, ppo_policy_loss
from agentrl.trainer.algorithms.recipes import add_to_last_sampled_token, dynamic_sampling_filter, overlong_filter_mask, overlong_reward_penalty, rollout_correction_weights

T = torch.tensor


# ---------------------------------------------------------------------------- GSPO


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    # row 0: log ratios [.2, -.1, .5] on 2 sampled tokens (the .5 is padding) -> mean .05,
    #   s0 = e^.05 = 1.05127 > 1 + .04: clipped; A = +1 -> loss per token max(-1.05127, -1.04) = -1.04
    # row 1: log ratios [-.3, .1, .05] -> mean -.05, s1 = e^-.05 = .951229 < 1 - .03: clipped;
    #   A = -2 -> max(2 * .951229, 2 * .97) = 1.94
    # seq-mean-token-mean: (-1.04 + 1.94) / 2 = .45; clipfrac: every token is clipped
    old = torch.zeros(2, 3)
    new = T([[0.2, -0.1, 0.5], [-0.3, 0.1, 0.05]])
    adv = T([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = gspo_policy_loss(new, old, adv, mask, clip_ratio_low=0.03, clip_ratio_high=0.04)
    assert_close(loss, T(0.45))
    assert_close(m["clipfrac"], T(1.0))
    # ppo_kl: mean of -(log ratio) over the 5 sampled tokens = -(.2 - .1 - .3 + .1 + .05) / 5 = .01
    assert_close(m["ppo_kl"], T(0.01))


def test_gspo_gradient_is_the_sequence_ratio_times_each_tokens_own_logprob_gradient():
    # unclipped (wide range): loss_i = -A_i * s_i per token, d/d logp_t = -A_i * s_i / (n_i * B_seqs)
    # one row, 2 tokens, log ratios [.1, .3]: s = e^.2; A = 1 -> grad each = -e^.2 / 2
    new = T([[0.1, 0.3]], requires_grad=True)
    loss, _ = gspo_policy_loss(new, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 10.0, 10.0)
    loss.backward()
    assert_close(new.grad, torch.full((1, 2), -math.exp(0.2) / 2))


def test_gspo_refuses_another_aggregation():
    with pytest.raises(ValueError, match="gspo.*seq-mean-token-mean.*'token-mean'"):
        policy_loss("gspo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                         clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")


# ---------------------------------------------------------------------------- CISPO


def test_cispo_weights_the_logprob_by_the_clipped_stopped_ratio():
    # tokens: logp [-1, -2], old [-1.5, -1.9]: ratios e^.5 = 1.6487 (clipped to 1.28), e^-.1 = .904837
    # (inside [0, 1.28]); A = [1, -1]:
    # losses -1.28 * 1 * -1 = 1.28, -.904837 * -1 * -2 = -1.809675; token-mean -.2648374
    logp = T([[-1.0, -2.0]], requires_grad=True)
    loss, m = cispo_policy_loss(logp, T([[-1.5, -1.9]]), T([[1.0, -1.0]]), torch.ones(1, 2),
                                     clip_ratio_low=1.0, clip_ratio_high=0.28)
    assert_close(loss, T((1.28 - 2 * math.exp(-0.1)) / 2))
    assert_close(m["clipfrac"], T(0.5))
    loss.backward()
    # the gradient flows through log p only, clipped tokens included: -sg(w) * A / 2
    assert_close(logp.grad, T([[-1.28 / 2, math.exp(-0.1) / 2]]))


def test_policy_loss_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*vanilla"):
        policy_loss("ppo2", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                         clip_ratio_low=0.2, clip_ratio_high=0.2)


# ---------------------------------------------------------------------------- rollout correction


def test_token_level_rollout_correction_truncates_at_the_cap():
    # log(trainer / engine) = [ln 3, ln .5, 0 (padding)] -> weights [min(3, 2), .5, 0]
    old = T([[math.log(3.0), math.log(0.5), 5.0]])
    engine = torch.zeros(1, 3)
    mask = T([[1.0, 1.0, 0.0]])
    w, m = rollout_correction_weights(old, engine, mask, "token", cap=2.0)
    assert_close(w, T([[2.0, 0.5, 0.0]]))
    assert_close(m["truncated_fraction"], T(0.5))
    assert_close(m["corrected_fraction"], T(0.5))
    assert_close(m["masked_fraction"], T(0.0))
    assert_close(m["weight_mean"], T(1.25))
    assert not w.requires_grad


def test_sequence_level_rollout_correction_is_the_product_of_token_ratios():
    # row 0: ratios 1.2 * 1.5 = 1.8 (< cap 2) on both tokens; row 1: 3 -> 2 on its one sampled
    # token (the padding's ratio 10 stays out of the product, which would be 30)
    old = torch.log(T([[1.2, 1.5], [3.0, 10.0]]))
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    w, m = rollout_correction_weights(old, torch.zeros(2, 2), mask, "sequence", cap=2.0)
    assert_close(w, T([[1.8, 1.8], [2.0, 0.0]]))
    assert_close(m["truncated_fraction"], T(1 / 3))


def test_decoupled_ppo_weighs_tokens_by_proximal_over_behaviour_and_masks_those_over_the_cap():
    # proximal / behaviour = [3, .5, 1.5, padding]: the 3 is over the cap 2, masked (not truncated to 2)
    old = torch.log(T([[3.0, 0.5, 1.5, 7.0]]))
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    w, m = rollout_correction_weights(old, torch.zeros(1, 4), mask, "token", cap=2.0, method="decoupled")
    assert_close(w, T([[0.0, 0.5, 1.5, 0.0]]))
    assert_close(m["masked_fraction"], T(1 / 3))
    assert_close(m["truncated_fraction"], T(0.0))
    with pytest.raises(ValueError, match="decoupled PPO weighs each token: level must be 'token', got 'sequence'"):
        rollout_correction_weights(old, torch.zeros(1, 4), mask, "sequence", method="decoupled")


@pytest.mark.parametrize("method", ["tis", "decoupled"])
def test_every_importance_weight_is_exactly_1_when_the_behaviour_policy_is_the_proximal_one(method):
    """eta = 0 with the engine's logprobs equal to the trainer's: behaviour weights exactly 1, and
    the PPO ratio of the on-policy update (old = the forward's own logprobs) exactly 1."""
    from agentrl.trainer.algorithms.losses import ppo_policy_loss

    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g) * 4
    mask = T([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] + [1.0] * 4])
    w, m = rollout_correction_weights(logprobs, logprobs.clone(), mask, "token", cap=2.0, method=method)
    assert torch.equal(w, mask)  # 1 exactly on every sampled token
    assert m["corrected_fraction"].item() == 0.0
    _, pg = ppo_policy_loss(logprobs, logprobs.detach(), torch.randn(3, 5, generator=g), mask, rollout_is_weights=w)
    assert pg["ppo_kl"].item() == 0.0 and pg["clipfrac"].item() == 0.0


def test_rollout_correction_masks_outliers_with_weight_zero():
    # token: ratios [1.5, 10, 1/20] with threshold 5: the last two are outliers
    old = torch.log(T([[1.5, 10.0, 0.05]]))
    w, m = rollout_correction_weights(old, torch.zeros(1, 3), torch.ones(1, 3), "token", cap=2.0,
                                           outlier_threshold=5.0)
    assert_close(w, T([[1.5, 0.0, 0.0]]))
    assert_close(m["masked_fraction"], T(2 / 3))
    assert_close(m["truncated_fraction"], T(0.0))  # the ratio 10 is masked, not counted as truncated
    assert_close(m["corrected_fraction"], T(2 / 3))
    # sequence: the geometric-mean token ratio decides; row 0 sqrt(10 * 1.2) = 3.46 < 5 kept (capped),
    # row 1 sqrt(40 * 1) = 6.3 > 5 masked as a whole
    old = torch.log(T([[10.0, 1.2], [40.0, 1.0]]))
    w, m = rollout_correction_weights(old, torch.zeros(2, 2), torch.ones(2, 2), "sequence", cap=2.0,
                                           outlier_threshold=5.0)
    assert_close(w, T([[2.0, 2.0], [0.0, 0.0]]))
    assert_close(m["masked_fraction"], T(0.5))


def test_rollout_correction_refuses_bad_settings():
    z, one = torch.zeros(1, 1), torch.ones(1, 1)
    with pytest.raises(ValueError, match="level 'tokens'"):
        rollout_correction_weights(z, z, one, "tokens")
    with pytest.raises(ValueError, match="cap must be positive"):
        rollout_correction_weights(z, z, one, "token", cap=0.0)
    with pytest.raises(ValueError, match="outlier_threshold must be > 1"):
        rollout_correction_weights(z, z, one, "token", outlier_threshold=0.5)


def test_rollout_weights_scale_each_tokens_policy_loss():
    # ratio 1, A = [1, 1]: losses [-1, -1] weighted [2, .5] -> token-mean -1.25
    loss, _ = ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                   rollout_is_weights=T([[2.0, 0.5]]))
    assert_close(loss, T(-1.25))


# ---------------------------------------------------------------------------- DAPO


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    # groups: 7 -> [1, 0] kept; 3 -> [1, 1] dropped; 5 -> [0, 0, 0] dropped; 9 -> [1] alone: kept (as verl)
    scores = T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = T([7, 3, 7, 3, 5, 5, 9, 5])
    kept, counts = dynamic_sampling_filter(scores, groups)
    assert kept.tolist() == [0, 2, 6]
    assert counts == {"groups_drawn": 4, "groups_kept": 2, "groups_dropped": 2, "trajectories_kept": 3}


def test_dynamic_sampling_tells_tiny_differences_from_equality():
    kept, counts = dynamic_sampling_filter(T([0.5, 0.5 + 1e-6]), T([0, 0]))
    assert kept.tolist() == [0, 1] and counts["groups_dropped"] == 0


def test_overlong_penalty_by_hand():
    # L_max 20, buffer 5: expected 15; lengths 10 -> 0, 15 -> 0, 17 -> -2/5, 20 -> -1 (factor 1); factor .5 halves
    lengths = T([10, 15, 17, 20])
    assert_close(overlong_reward_penalty(lengths, 20, 5), T([0.0, 0.0, -0.4, -1.0]))
    assert_close(overlong_reward_penalty(lengths, 20, 5, 0.5), T([0.0, 0.0, -0.2, -0.5]))
    with pytest.raises(ValueError, match="overlong buffer length must be in \\(0, max_response_length=20\\), got 20"):
        overlong_reward_penalty(lengths, 20, 20)


def test_the_overlong_penalty_lands_on_the_last_sampled_token():
    # rows: s o s pad -> t2; o s o -> t1; empty row -> nothing
    mask = T([[1.0, 0, 1, 0], [0.0, 1, 0, 0], [0.0, 0, 0, 0]])
    out = add_to_last_sampled_token(torch.ones(3, 4), mask, T([-0.4, -1.0, -5.0]))
    assert_close(out, T([[1.0, 1, 0.6, 1], [1.0, 0, 1, 1], [1.0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="one entry per row"):
        add_to_last_sampled_token(torch.ones(3, 4), mask, T([1.0]))


def test_overlong_filter_zeroes_the_mask_of_truncated_responses():
    mask = T([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    assert_close(overlong_filter_mask(T([True, False]), mask), T([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="one entry per row"):
        overlong_filter_mask(T([True]), mask)


# ---------------------------------------------------------------------------- Dr.GRPO and estimate_advantages


def test_drgrpo_recipe_math_by_hand():
    # group [1, 0, 0] (one token each... lengths 1, 2, 3): advantages without std: [2/3, -1/3, -1/3]
    # loss = sum over sequences of token sums / L (L = 8), ratio 1: -(2/3 - 2/3 - 1) / 8 = 1/8
    rewards = T([[1.0, 0, 0], [0.0, 0, 0], [0.0, 0, 0]])
    mask = T([[1.0, 0, 0], [1.0, 1, 0], [1.0, 1, 1]])
    adv, _ = estimate_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=T([0, 0, 0]),
                                      norm_adv_by_std_in_grpo=False)
    assert_close(adv, T([[2 / 3, 0, 0], [-1 / 3, -1 / 3, 0], [-1 / 3, -1 / 3, -1 / 3]]))
    z = torch.zeros(3, 3)
    loss, _ = ppo_policy_loss(z, z, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=8)
    assert_close(loss, T(1 / 8))


def test_grpo_turn_credit_switch_selects_agentrls_per_turn_returns():
    # one trajectory of two turns in a group with a one-turn trajectory; turn rewards [0, 1] and [1]
    turn_rewards, num_turns = T([[0.0, 1.0], [1.0, 0.0]]), T([2, 1])
    turn_ids = T([[0, -1, 1], [0, -1, -1]])
    mask = T([[1.0, 0, 1], [1.0, 0, 0]])
    token_rewards = T([[0.0, 0, 1], [1.0, 0, 0]])
    common = dict(token_rewards=token_rewards, response_mask=mask, group_ids=T([0, 0]))
    per_turn, _ = estimate_advantages("grpo", grpo_turn_credit=True, turn_rewards=turn_rewards,
                                           num_turns=num_turns, turn_ids=turn_ids, **common)
    assert_close(per_turn, turn_level_advantages(turn_rewards, num_turns, turn_ids, mask, T([0, 0])))
    outcome, _ = estimate_advantages("grpo", **common)
    assert_close(outcome, torch.zeros(2, 3))  # verl: both trajectories score 1, an all-equal group
    with pytest.raises(ValueError, match="grpo_turn_credit needs turn_rewards"):
        estimate_advantages("grpo", grpo_turn_credit=True, **common)
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        estimate_advantages("gae", **common)
    with pytest.raises(ValueError, match="unknown adv_estimator 'ppo'"):
        estimate_advantages("ppo", **common)


# ---------------------------------------------------------------------------- config groups


def test_algorithm_dapo_is_one_override():
    # trainer=default: the quickstart's trainer group (after algorithm in the defaults list) adds
    # its KL loss to whichever algorithm is chosen
    assert load_config("train", ["algorithm=dapo"]).actor.use_kl_loss
    cfg = load_config("train", ["algorithm=dapo", "trainer=default"])
    a, actor = cfg.algorithm, cfg.actor
    assert a.adv_estimator == "grpo" and not a.use_kl_in_reward
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert a.filter_groups.enable and a.filter_groups.max_num_gen_batches == 10
    assert a.overlong_buffer.enable and a.overlong_buffer.len == 102 and a.overlong_buffer.penalty_factor == 1.0
    assert actor.policy_loss == "vanilla" and not actor.use_kl_loss and cfg.critic.enable is False


def test_algorithm_gspo_cispo_drgrpo_are_one_override_each():
    gspo = load_config("train", ["algorithm=gspo"]).actor
    assert (gspo.policy_loss, gspo.loss_agg_mode, gspo.clip_ratio_low, gspo.clip_ratio_high) == (
        "gspo", "seq-mean-token-mean", 3e-4, 4e-4)
    cispo = load_config("train", ["algorithm=cispo"]).actor
    assert (cispo.policy_loss, cispo.clip_ratio_low, cispo.clip_ratio_high) == ("cispo", 1.0, 0.28)
    dr = load_config("train", ["algorithm=drgrpo", "data.max_response_length=300"])
    assert dr.algorithm.adv_estimator == "grpo" and dr.algorithm.norm_adv_by_std_in_grpo is False
    assert dr.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert dr.actor.loss_scale_factor == 300 and dr.critic.loss_scale_factor == 300  # null: max_response_length
    assert load_config("train", ["algorithm=drgrpo", "actor.loss_scale_factor=4096"]).actor.loss_scale_factor == 4096


def test_rollout_correction_is_configured_under_actor():
    cfg = load_config("train", ["actor.rollout_correction.level=sequence", "actor.rollout_correction.outlier_threshold=4"])
    rc = cfg.actor.rollout_correction
    assert (rc.level, rc.cap, rc.outlier_threshold) == ("sequence", 2.0, 4.0)
    assert load_config("train").actor.rollout_correction.level is None  # off by default


def test_recipe_settings_that_contradict_each_other_are_refused_naming_the_keys():
    with pytest.raises(ConfigError) as info:
        load_config("train", ["algorithm=gspo", "actor.loss_agg_mode=token-mean"])
    assert "actor.policy_loss=gspo needs actor.loss_agg_mode=seq-mean-token-mean" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config("train", ["actor.policy_loss=ppo2"])
    assert "policy_loss" in str(info.value)

"""agentrl.trainer.algorithms became a package of one module a concern; the names the single
module offered stay importable from the package, each the object its submodule defines."""

import importlib

import agentrl.trainer.algorithms as algorithms

BEFORE_THE_SPLIT = [
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


def test_the_package_offers_every_name_the_single_module_did():
    assert sorted(algorithms.__all__) == sorted(BEFORE_THE_SPLIT)
    for name in BEFORE_THE_SPLIT:
        obj = getattr(algorithms, name)
        module = getattr(obj, "__module__", "")
        if module.startswith("agentrl.trainer.algorithms."):  # functions and classes: the submodule's own
            assert getattr(importlib.import_module(module), name) is obj, name

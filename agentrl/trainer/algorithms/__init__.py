"""RL algorithms as pure tensor functions (no state but the KL controllers), one module a concern:

    masked.py      masked statistics (mean, variance, whitening) and the shape check
    advantages.py  the advantage estimators and turn-level credit
    kl.py          KL estimators, KL as a reward penalty, the KL controllers
    losses.py      loss aggregation and its denominator, policy losses, value loss, entropy
    recipes.py     rollout correction, DAPO's dynamic sampling and overlong shaping

Where a function carries a verl name it computes verl's formula (verl/trainer/ppo/core_algos.py
and ``apply_kl_penalty`` in its ray_trainer.py at b178a3cd), pinned at 1e-5 by
tests/trainer/test_verl_parity.py; docs/algorithms.md lists every algorithm, its config keys
and its test, and the deliberate differences with their switches.

Conventions: response tensors are (B, T), right-padded. ``response_mask`` is the loss mask: 1
on tokens the policy sampled, 0 on observed tokens inside the response (tool results, user
turns) and on padding. ``token_rewards`` (B, T) carry rewards on any token: each assistant
turn's reward on its last token, the trajectory reward on the last sampled token.
``group_ids`` (B,) says which samples answer the same prompt. Everything is fp32.
"""

# The names the single module offered (its __all__), importable from the package as before.
from agentrl.trainer.algorithms.masked import (  # noqa: E402
    masked_mean,
    masked_var,
    masked_whiten,
)
from agentrl.trainer.algorithms.advantages import (  # noqa: E402
    AdvantageEstimator,
    ESTIMATORS,
    compute_gae,
    compute_grpo_advantages,
    compute_rloo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_turn_returns,
    estimate_advantages,
    turn_level_advantages,
)
from agentrl.trainer.algorithms.kl import (  # noqa: E402
    KLKind,
    kl_penalty,
    apply_kl_penalty,
    kl_for_controller,
    FixedKLController,
    AdaptiveKLController,
)
from agentrl.trainer.algorithms.losses import (  # noqa: E402
    LossAggMode,
    aggregate_loss,
    loss_denominator,
    PolicyLoss,
    POLICY_LOSSES,
    ppo_policy_loss,
    gspo_policy_loss,
    cispo_policy_loss,
    policy_loss,
    value_loss,
    entropy_from_logits,
    entropy_from_logprobs,
)
from agentrl.trainer.algorithms.recipes import (  # noqa: E402
    RolloutCorrectionLevel,
    rollout_correction_weights,
    dynamic_sampling_filter,
    overlong_reward_penalty,
    overlong_filter_mask,
    add_to_last_sampled_token,
)

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

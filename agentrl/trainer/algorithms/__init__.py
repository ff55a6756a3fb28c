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

"""What a ``trained`` role needs of the rest of the config, checked before any work.

A role marked ``agent.roles.<role>=trained`` (docs/roles.md) gets a policy of its own: full
weights, an optimizer and a weight version, trained beside the main policy in the trainer's
process and served by the built-in engine next to it (``agentrl.engines.policies``,
``agentrl.trainer.role_policies``). That is built for one configuration: one actor rank in the
trainer's process, the built-in engine in the trainer's process syncing in memory, synchronous
training, no critic, no KL in the reward (full weights or, with ``actor.lora.rank``, an adapter per
role on the role's own copy of the base). Every other setting is refused here,
naming its key, rather than run with the role silently trained some other way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["trained_roles", "trained_roles_problems"]

SUPPORTED = ("a trained role's own policy is built for one actor rank in the trainer's process (trainer.workers=auto|local), "
             "the built-in engine in that process syncing in memory, synchronous training without a critic or "
             "KL in the reward (docs/roles.md)")


def trained_roles(cfg: Any) -> list[str]:
    """The roles the config marks ``trained``, in a stable order."""
    return sorted(role for role, policy in cfg.agent.roles.items() if policy == "trained")


def trained_roles_problems(cfg: Any) -> list[tuple[str, str]]:
    """(key, problem) for each setting a trained role cannot run with; empty without trained roles."""
    roles = trained_roles(cfg)
    if not roles:
        return []
    what = ", ".join(f"agent.roles.{role}=trained" for role in roles)
    refused = [
        ("actor.world_size", cfg.actor.world_size, cfg.actor.world_size != 1),
        ("trainer.workers", cfg.trainer.workers, cfg.trainer.workers == "ray"),
        ("trainer.max_restarts", cfg.trainer.max_restarts, cfg.trainer.max_restarts != 0),
        ("engine.backend", cfg.engine.backend, cfg.engine.backend != "builtin"),
        ("engine.process", cfg.engine.process, cfg.engine.process is True),
        ("engine.weight_sync", cfg.engine.weight_sync, cfg.engine.weight_sync not in ("auto", "memory")),
        ("rollout.max_staleness", cfg.rollout.max_staleness, cfg.rollout.max_staleness > 0),
        ("critic.enable", cfg.critic.enable, cfg.critic.enable),
        ("algorithm.use_kl_in_reward", cfg.algorithm.use_kl_in_reward, cfg.algorithm.use_kl_in_reward),
    ]
    return [(key, f"{key}={str(value).lower() if isinstance(value, bool) else value} is not supported with {what}: {SUPPORTED}")
            for key, value, bad in refused if bad]

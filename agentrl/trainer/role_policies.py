"""Trained roles: a policy of its own per role (``agent.roles.<role>=trained``, docs/roles.md).

Each trained role has an actor of its own (``actor@<role>``: full weights started from the same
policy as the main actor, the SFT warm start's when there is one, its own optimizer and schedule)
and its own **weight version**. The main actor's engine serves every policy
(``RolesActorWorker``: ``agentrl.engines.policies.PolicyEngines``, one built-in engine per policy);
a trained role's requests name the role as their policy (``agentrl.agent.roles``), so its turns
are sampled from its own weights and its trajectories carry its own version.

A step splits the trajectories by policy: the shared roles' train the main policy (the trainer's
own step, unchanged), each trained role's train that role's policy only, through a
``TrainingStep`` of its own over the same reference. Advantages are per group, and a role's groups
are its own (``<group>@<role>``), so the split changes no GRPO / RLOO advantage. Each trained
policy is checked against its own version before its step (``check_weight_versions``), synced to
the engine with its version + 1 after it, and watched by a ``HealthMonitor`` of its own on its
``policy/<role>/health/*`` measures (the engine's reported version against the synced one, the
engine-trainer logprob mismatch of its tokens). Its metrics are the step's under
``policy/<role>/`` (``policy/<role>/weight_version``, ``policy/<role>/actor/pg_loss``, ...).

Checkpoints: each policy's actor state under ``<checkpoint>/policy@<role>/actor``, its version in
the trainer state (``policy_versions``). Only the configuration ``agentrl.config.trained_roles``
allows is built (one actor rank in the trainer's process, the built-in engine, synchronous).
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from agentrl.config.trained_roles import trained_roles
from agentrl.engines.policies import MAIN_POLICY, PolicyEngines
from agentrl.errors import CheckpointError, ConfigError
from agentrl.trainer.health import HealthMonitor, HealthStop, step_health_metrics
from agentrl.trainer.step import Groups, TrainingStep, check_weight_versions, failure_metrics
from agentrl.trainer.workers import ActorWorker, _bounded_sync
from agentrl.trajectory import Trajectory

__all__ = ["RolesActorWorker", "RolePolicies", "policy_checkpoint"]


def policy_checkpoint(directory: str | Path, role: str) -> Path:
    """Where a trained role's actor state sits in a checkpoint directory."""
    return Path(directory) / f"policy@{role}"


class RolesActorWorker(ActorWorker):
    """The main actor when roles are trained: its engine serves the main policy and each trained
    role's own (``PolicyEngines``); ``sync_policy`` loads a role's weights and version into it."""

    def _builtin_engine(self, setup: Any) -> PolicyEngines:
        from agentrl.engines.builtin import BuiltinEngine

        engines = {MAIN_POLICY: super()._builtin_engine(setup)}
        for role in sorted(r for r, p in setup.roles.items() if p == "trained"):
            # its own copy of the weights, loaded with the starting checkpoint's and replaced by the
            # role's actor at the first sync (version 0); its own seed stream
            engines[role] = BuiltinEngine(
                self.model_path, device=str(self.device), dtype=self.param_dtype, max_batch_size=setup.engine_max_batch_size,
                seed=(setup.seed + zlib.crc32(role.encode())) & 0x7FFFFFFF, decode_graphs=setup.engine_decode_graphs,
                steps_on="event_loop")
        return PolicyEngines(engines)

    def sync_policy(self, role: str, state: Mapping[str, Any], version: int) -> int:
        """Copy the role's policy weights into its engine at ``version``; returns the version that
        engine then reports holding. Later trajectories of the role carry that version."""
        engine = self.engine
        assert isinstance(engine, PolicyEngines), "sync_policy on an actor whose engine serves one policy"
        asyncio.run(_bounded_sync(self, engine.update_weights(state_dict=state, version=version, policy=role), version,
                                  f"role {role!r}'s policy, an in-memory copy"))
        for ctx in self.contexts.values():
            ctx.policy_versions = {**ctx.policy_versions, role: version}
        return int(engine.engine(role).weight_version)


class RolePolicies:
    """The trained roles' actors, versions, steps and health monitors (built by ``start``)."""

    def __init__(self, cfg: Any, groups: Mapping[str, Any], steps: Mapping[str, TrainingStep], say: Callable[[str], None]):
        self.cfg = cfg
        self.groups = dict(groups)
        self.steps = dict(steps)
        self.versions = {role: 0 for role in self.groups}
        self.served: dict[str, int] = {}  # what the engine reported after each role's last sync
        self.monitors = {role: HealthMonitor(cfg.trainer.health, say=lambda text, r=role: say(f"policy {r!r}: {text}"),
                                             weight_sync="memory") for role in self.groups}

    @classmethod
    def start(cls, cfg: Any, group_cls: type, *, in_process: bool, policy_source: str, total_steps: int, env: dict[str, str],
              dist: dict[str, Any], reference: Any, pad_token_id: int, say: Callable[[str], None]) -> "RolePolicies | None":
        """One actor per trained role, from ``policy_source`` (None when no role is trained)."""
        roles = trained_roles(cfg)
        if not roles:
            return None
        if not in_process:  # the config check refuses what it can see; RAY_ADDRESS or placement set the rest
            raise ConfigError([("trainer.workers", f"agent.roles.{roles[0]}=trained runs in the trainer's process only; "
                                                   "this job runs its workers under Ray (RAY_ADDRESS or engine.placement=ray)")])
        groups = {role: group_cls(ActorWorker, world_size=1, env=env, name=f"actor@{role}", model_path=policy_source,
                                  config=cfg.actor, total_steps=max(1, total_steps), rollout_setup=None,
                                  gradient_checkpointing=cfg.model.gradient_checkpointing, temperature=cfg.rollout.temperature,
                                  share_prompts=cfg.model.share_prompt_forward, **dist)
                  for role in roles}
        steps = {role: TrainingStep(cfg, Groups(group, reference, None), pad_token_id=pad_token_id) for role, group in groups.items()}
        return cls(cfg, groups, steps, say)

    # ------------------------------------------------------------------ weights
    def sync(self, main_actor: Any, role: str, version: int) -> None:
        """The role's weights into the main actor's engine at ``version``."""
        state = self.groups[role].call_rank0("policy_state")
        self.served[role] = main_actor.call_rank0("sync_policy", role, state, version)
        self.versions[role] = version

    def sync_all(self, main_actor: Any, versions: Mapping[str, int] | None = None) -> None:
        for role in self.groups:
            self.sync(main_actor, role, (versions or {}).get(role, self.versions[role]))

    # ------------------------------------------------------------------ the step
    def split(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], dict[str, list[Trajectory]]]:
        """(the main policy's trajectories, each trained role's own)."""
        own: dict[str, list[Trajectory]] = {role: [] for role in self.groups}
        main = []
        for t in trajectories:
            (own[t.role] if t.role in own else main).append(t)
        return main, own

    def check_rollout(self, own: Mapping[str, list[Trajectory]], *, step: int) -> None:
        """Before any update of the step: each role's trajectories were sampled at its policy's
        version, and its infrastructure failures stay within ``trainer.max_failure_rate``
        (``RolloutFailed`` naming the policy; the run's checkpoint is then of the step before)."""
        for role, trajectories in own.items():
            where = f"step {step + 1}, role {role!r}'s policy"
            check_weight_versions(trajectories, self.versions[role], where=where)
            failure_metrics(trajectories, max_rate=self.cfg.trainer.max_failure_rate, where=where)

    def train(self, main_actor: Any, own: Mapping[str, list[Trajectory]], *, step: int) -> dict[str, float]:
        """Each trained role's step on its own trajectories, then its sync; its metrics under
        ``policy/<role>/``. (``check_rollout`` first.)"""
        metrics: dict[str, float] = {}
        self.check_rollout(own, step=step)
        for role, trajectories in own.items():
            if not trajectories:
                continue
            sampled_by = self.versions[role]
            result = self.steps[role].online(trajectories, step=step)
            part = {**result.metrics, **step_health_metrics(trajectories, result.batch, sampled_by,
                                                            estimator=self.cfg.algorithm.adv_estimator)}
            if result.updated_actor:
                self.sync(main_actor, role, sampled_by + 1)
                part.update({"health/synced_version": float(self.versions[role]),
                             "health/engine_version": float(self.served[role])})
            part["weight_version"] = float(self.versions[role])
            metrics.update({f"policy/{role}/{key}": value for key, value in part.items()})
        return metrics

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        """Each policy's health measures against the bounds (``trainer.health``): a stop names the policy."""
        for role, monitor in self.monitors.items():
            prefix = f"policy/{role}/"
            own = {key[len(prefix):]: value for key, value in metrics.items() if key.startswith(prefix)}
            try:
                monitor.check(step, own)
            except HealthStop as stop:
                raise HealthStop(f"policy {role!r}: {stop}", step=stop.step, key=stop.key, measure=f"{prefix}{stop.measure}",
                                 value=stop.value) from None

    # ------------------------------------------------------------------ checkpoints and the rest
    def save(self, directory: Path) -> dict[str, int]:
        for role, group in self.groups.items():
            group.call_all("save", str(policy_checkpoint(directory, role)))
        return dict(self.versions)

    def load(self, directory: Path, versions: Any) -> dict[str, int]:
        """Each role's actor from the checkpoint; returns the versions to sync (checked: one per role)."""
        if not isinstance(versions, dict) or set(versions) != set(self.groups) or not all(isinstance(v, int) for v in versions.values()):
            raise CheckpointError(f"{directory}: trainer state: policy_versions must give the version of every trained role "
                                  f"({', '.join(self.groups)}), got {versions!r}")
        for role, group in self.groups.items():
            group.call_all("load", str(policy_checkpoint(directory, role)))
        return dict(versions)

    def export(self, run_path: Path) -> None:
        """Each role's policy as a transformers checkpoint, ``policy@<role>/`` beside the run's ``policy/``."""
        for role, group in self.groups.items():
            group.call_all("export_hf", str(Path(run_path) / f"policy@{role}"))

    def during(self, label: str) -> None:
        for group in self.groups.values():
            group.during = label

    def kill(self) -> None:
        for group in self.groups.values():
            group.kill()


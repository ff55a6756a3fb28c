"""Train from stored trajectories (``agentrl replay train``), off-policy corrected.

The stored logprobs are the *behaviour* policy's (the engine that sampled, maybe another
policy or an older one); the policy being trained recomputes its own. Each sampled token's loss
is weighted by the truncated importance ratio ``min(exp(old - stored), max_ratio)``; see
``agentrl/trainer/step.py``, the training step this shares with online training. When the
stored logprobs are the policy's own, the ratio is exactly 1 and the update is the online
step's. The mismatch is reported each step: ``logprob_mismatch/mean|max`` (|old - stored|, as
online), ``replay/ratio_mean|max`` and ``replay/truncated_fraction``.

One stored step (of one split) is one batch, trained in the order stored. Groups the online run
stored without training them (``dropped``: an asynchronous run's stale groups) are skipped, as
that run skipped them, unless ``include_dropped`` (``--include-dropped``) trains them too; the
summary counts the trajectories skipped (``dropped_skipped``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from agentrl.config import TrainConfig
from agentrl.config.trained_roles import trained_roles
from agentrl.errors import ConfigError, DataError
from agentrl.rundir import RunDir
from agentrl.trainer.algorithms.kl import AdaptiveKLController, FixedKLController
from agentrl.trainer.step import Groups, TrainingStep, truncated_importance_weights
from agentrl.trajectory import Trajectory

if TYPE_CHECKING:
    from agentrl.data.rollout_store import RolloutStore

__all__ = ["truncated_importance_weights", "replay_step", "train_from_store", "batches_to_train", "stored_batch"]


def replay_step(
    groups: Groups,
    trajectories: Sequence[Trajectory],
    cfg: TrainConfig,
    *,
    pad_token_id: int,
    max_ratio: float,
    kl_ctrl: Any = None,
    update_actor: bool = True,
) -> dict[str, float]:
    """One off-policy corrected update from stored trajectories (the shared training step);
    returns the step's metrics."""
    step = TrainingStep(cfg, groups, pad_token_id=pad_token_id, kl_ctrl=kl_ctrl)
    return step.replay(trajectories, max_ratio=max_ratio, update_actor=update_actor).metrics


# ----------------------------------------------------------------------------- the job


def batches_to_train(store: "RolloutStore", *, split: str, steps: tuple[int | None, int | None] | None,
                     include_dropped: bool = False) -> tuple[list[int], int]:
    """The stored steps of ``split`` in ``steps`` that hold trajectories to train, and how many
    stored trajectories are skipped as their groups' online run skipped them (``dropped``; 0
    with ``include_dropped``)."""
    from agentrl.data.rollout_store import TrajectoryFilter

    keys = store.read_table(["step", "dropped"], TrajectoryFilter(split=split, steps=steps))
    marks = list(zip(keys.column("step").to_pylist(), keys.column("dropped").to_pylist()))
    skipped = 0 if include_dropped else sum(reason is not None for _, reason in marks)
    return sorted({s for s, reason in marks if include_dropped or reason is None}), skipped


def stored_batch(store: "RolloutStore", split: str, step: int, *, include_dropped: bool = False) -> list[Trajectory]:
    """One stored step's trajectories to train, in the order stored: its trained groups (with
    ``include_dropped``, its dropped groups too)."""
    from agentrl.data.rollout_store import TrajectoryFilter

    where = TrajectoryFilter(split=split, steps=(step, step + 1), dropped=None if include_dropped else False)
    return list(store.iter_trajectories(where))


def train_from_store(
    store: "RolloutStore",
    cfg: TrainConfig,
    out_dir: Path,
    *,
    split: str = "train",
    steps: tuple[int | None, int | None] | None = None,
    max_ratio: float = 2.0,
    epochs: int = 1,
    include_dropped: bool = False,
) -> dict[str, Any]:
    """Train the configured policy (``model.path``, else the tiny model) on every stored step
    of ``split`` in ``steps``, ``epochs`` times, on worker groups as ``agentrl train`` does (in this process for one rank each).
    Writes ``config.yaml``, ``metrics.jsonl``, ``policy/`` (when ``trainer.export_hf``) and
    ``summary.json`` into the run directory ``out_dir``; returns the summary."""
    from transformers import AutoTokenizer

    from agentrl.trainer.skilled_base import ensure_model
    from agentrl.trainer.in_process import InProcessGroup, runs_in_process
    from agentrl.trainer.logging import MetricsLogger
    from agentrl.trainer.cluster import init_local_ray, placed, plan_groups, threads_per_worker, worker_env
    from agentrl.trainer.groups import WorkerGroup
    from agentrl.trainer.workers import ActorWorker, CriticWorker, ReferenceWorker

    if trained_roles(cfg):  # one policy here: a trained role's rows would train the main policy (docs/roles.md)
        raise ConfigError([(f"agent.roles.{role}", "trained: replay retraining trains one policy; a role's own policy "
                            "is trained by agentrl train only (here use shared)") for role in trained_roles(cfg)])
    stored_steps, skipped = batches_to_train(store, split=split, steps=steps, include_dropped=include_dropped)
    if not stored_steps:
        raise DataError(f"no stored {split} trajectories in steps {_steps_text(steps)}", file=str(store.root))
    total = len(stored_steps) * epochs
    model_path = str(ensure_model(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # one rank per group: the groups in this process, as agentrl train does (trainer.workers)
    in_process = runs_in_process(cfg)
    Group = InProcessGroup if in_process else WorkerGroup
    # everything started here is stopped on every path, a group that fails to start included:
    # the groups already running, and the Ray this call started
    started: list[Any] = []
    started_ray = False
    log: MetricsLogger | None = None
    done = 0
    last: dict[str, float] = {}
    try:
        started_ray = False if in_process else init_local_ray(cfg.trainer.ship_code)
        env = worker_env(threads=threads_per_worker(cfg))
        dist = dict(device=cfg.trainer.device, seed=cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s,
                    stacks_dir=str(out_dir))
        plan = {} if in_process else plan_groups(cfg, actor_cpus=0.01)  # GPUs, and the bundles the groups share
        actor = Group(ActorWorker, world_size=cfg.actor.world_size, env=env, name="actor", **placed(plan, "actor"),
                      model_path=model_path, config=cfg.actor, total_steps=total, temperature=cfg.rollout.temperature,
                      share_prompts=cfg.model.share_prompt_forward, **dist)
        started.append(actor)
        groups = Groups(actor=actor)
        if cfg.use_reference:
            groups.reference = Group(ReferenceWorker, world_size=cfg.actor.world_size, env=env, name="reference",
                                     **placed(plan, "reference", actor), model_path=model_path,
                                     temperature=cfg.rollout.temperature, share_prompts=cfg.model.share_prompt_forward, **dist)
            started.append(groups.reference)
        if cfg.critic.enable:
            groups.critic = Group(CriticWorker, world_size=cfg.critic.world_size, env=env, name="critic",
                                  **placed(plan, "critic", actor), model_path=model_path, config=cfg.critic, total_steps=total,
                                  share_prompts=cfg.model.share_prompt_forward, **dist)
            started.append(groups.critic)
        kl = cfg.algorithm.kl_ctrl
        kl_ctrl = AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive" else FixedKLController(kl.kl_coef)
        out_dir.mkdir(parents=True, exist_ok=True)
        run = RunDir(out_dir)
        run.write_config(cfg)
        log = MetricsLogger(run.path, cfg.logging)
        step = TrainingStep(cfg, groups, pad_token_id=pad_id, kl_ctrl=kl_ctrl)
        for _ in range(epochs):
            for source_step in stored_steps:
                trajectories = stored_batch(store, split, source_step, include_dropped=include_dropped)
                last = step.replay(trajectories, max_ratio=max_ratio, update_actor=done >= cfg.trainer.critic_warmup,
                                   where=f"stored {split} step {source_step}").metrics
                last["replay/source_step"] = float(source_step)
                done += 1
                log.log(done, last)
        if cfg.trainer.export_hf:
            actor.call_all("export_hf", str(run.policy))
    finally:
        if log is not None:
            log.close()
        for group in started:
            group.kill()
        if started_ray:
            import ray

            ray.shutdown()
    summary = {"store": str(store.root), "split": split, "source_steps": stored_steps, "updates": done, "max_ratio": max_ratio,
               "dropped_skipped": skipped,
               "model": model_path, **{k: last[k] for k in ("logprob_mismatch/mean", "replay/ratio_mean", "replay/truncated_fraction")}}
    run.write_summary(summary)
    return summary


def _steps_text(steps: tuple[int | None, int | None] | None) -> str:
    first, stop = steps or (None, None)
    return f"{'' if first is None else first}:{'' if stop is None else stop}"

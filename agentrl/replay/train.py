"""Train from stored trajectories (``agentrl replay train``), off-policy corrected.

The stored logprobs are the *behaviour* policy's (the engine that sampled, maybe another
policy or an older one); the policy being trained recomputes its own (the old logprobs of the
PPO ratio). Each sampled token's loss is weighted by the truncated importance ratio

    w = min(exp(old_logprob - stored_logprob), max_ratio)          (0 on observed tokens)

applied by scaling the token's advantage (the PPO loss, clipped or dual-clipped, is
positively homogeneous in the advantage, so this equals weighting the token's loss by w).
When the stored logprobs are the policy's own, w is exactly 1 and the update is the online
step's. The mismatch is reported each step: ``logprob_mismatch/mean|max`` (|old - stored|, as
online), ``replay/ratio_mean|max`` and ``replay/truncated_fraction``.

One stored step (of one split) is one batch, trained in the order stored; the step reads like
the online one: old logprobs -> reference logprobs -> values -> advantages -> importance
weights -> critic update -> actor update.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from agentrl.config import TrainConfig
from agentrl.errors import DataError
from agentrl.trainer import algorithms as algo
from agentrl.trainer.batch import TrainBatch, collate
from agentrl.trainer.run import _shards, compute_advantages, trajectory_metrics
from agentrl.trainer.workers import mini_batch_denominator
from agentrl.trajectory import Trajectory

if TYPE_CHECKING:
    from agentrl.replay.store import RolloutStore

__all__ = ["truncated_importance_weights", "ReplayGroups", "replay_step", "LocalGroup", "train_from_store"]


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, max_ratio: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, R) weights ``min(exp(old - behaviour), max_ratio)`` on sampled tokens (0 elsewhere),
    and the mismatch metrics."""
    if max_ratio <= 0:
        raise ValueError(f"max_ratio must be > 0, got {max_ratio}")
    delta = (old_logprobs - behaviour_logprobs) * mask  # (B, R)
    ratio = torch.exp(delta) * mask  # (B, R)
    weights = ratio.clamp(max=max_ratio)  # (B, R)
    count = mask.sum().clamp(min=1)
    metrics = {
        "logprob_mismatch/mean": float(delta.abs().sum() / count),
        "logprob_mismatch/max": float(delta.abs().max()) if delta.numel() else 0.0,
        "replay/ratio_mean": float(ratio.sum() / count),
        "replay/ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
        "replay/truncated_fraction": float(((ratio > max_ratio) * mask).sum() / count),
    }
    return weights, metrics


class Group(Protocol):
    """What the step needs of a worker group (``trainer.workers.WorkerGroup`` or ``LocalGroup``)."""

    world_size: int

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...


class LocalGroup:
    """One worker in this process as a group of world size 1 (tests, debugging)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.world_size = 1

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(shards[0], *args, **kwargs)]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]


@dataclass
class ReplayGroups:
    actor: Group
    reference: Group | None = None
    critic: Group | None = None


def replay_step(
    groups: ReplayGroups,
    trajectories: Sequence[Trajectory],
    cfg: TrainConfig,
    *,
    pad_token_id: int,
    max_ratio: float,
    kl_ctrl: Any = None,
    update_actor: bool = True,
) -> dict[str, float]:
    """One update from stored trajectories; returns the step's metrics."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    usable = [t for t in trajectories if t.finish_reason != "loop_error" and t.response_ids]
    if not usable:
        raise DataError(f"none of the {len(trajectories)} stored trajectories has tokens to train on")
    batch = collate(usable, pad_token_id=pad_token_id, max_prompt_length=cfg.data.max_prompt_length,
                    max_response_length=cfg.data.max_response_length)
    group_size = max(Counter(t.group_id for t in usable).values())
    actor, W = groups.actor, groups.actor.world_size
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    with _timed(timings, "old_logprobs"):
        parts = actor.call_sharded("compute_logprobs", _shards(batch, W), micro)
        old, entropy = (torch.cat([p[i] for p in parts])[: len(batch)] for i in (0, 1))
        batch = batch.replace(old_logprobs=old)
    if groups.reference is not None:
        with _timed(timings, "ref_logprobs"):
            ref = torch.cat(groups.reference.call_sharded("compute_logprobs", _shards(batch, groups.reference.world_size), micro))
            batch = batch.replace(ref_logprobs=ref[: len(batch)])
    if groups.critic is not None:
        with _timed(timings, "values"):
            values = groups.critic.call_sharded("compute_values", _shards(batch, groups.critic.world_size),
                                                cfg.critic.ppo_micro_batch_size_per_gpu)
            batch = batch.replace(values=torch.cat(values)[: len(batch)])
    with _timed(timings, "advantages"):
        batch, metrics = compute_advantages(batch, cfg, kl_ctrl.value if kl_ctrl is not None else None)
        weights, mismatch = truncated_importance_weights(batch.old_logprobs, batch.engine_logprobs, batch.response_mask, max_ratio)
        batch = batch.replace(advantages=batch.advantages * weights)
    metrics.update(mismatch)
    if groups.critic is not None:
        with _timed(timings, "critic_update"):
            metrics.update(_update(groups.critic, batch, cfg.critic.ppo_mini_batch_size * group_size, cfg.critic.ppo_epochs,
                                   cfg.actor.loss_agg_mode, loss_agg_mode=cfg.actor.loss_agg_mode))
    if update_actor:
        with _timed(timings, "actor_update"):
            metrics.update(_update(actor, batch, cfg.actor.ppo_mini_batch_size * group_size, cfg.actor.ppo_epochs,
                                   cfg.actor.loss_agg_mode, use_kl_loss=cfg.actor.use_kl_loss))
    mask = batch.response_mask
    metrics.update(trajectory_metrics(trajectories))
    metrics.update(timings)
    metrics.update({
        "entropy/mean": float(algo.masked_mean(entropy, mask)),
        "tokens/sampled": float(mask.sum()),
        "trajectories/loop_errors": float(len(trajectories) - len(usable)),
        "timing/step_s": time.perf_counter() - start,
    })
    if batch.ref_logprobs is not None:
        metrics["kl/policy_ref"] = float(algo.masked_mean(algo.kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1"), mask))
        if kl_ctrl is not None and cfg.algorithm.use_kl_in_reward:
            kl_ctrl.update(metrics["kl/policy_ref"], len(batch))
    return metrics


def _update(group: Group, batch: TrainBatch, mini_size: int, epochs: int, mode: str, **kwargs: Any) -> dict[str, float]:
    """Mini-batches of ``mini_size`` trajectories (as the online step), each sharded over the ranks."""
    minis = [mb for _ in range(epochs) for mb in batch.split(mini_size)]
    denominators = [mini_batch_denominator(mb.response_mask, mode) for mb in minis]
    shards = [_shards(mb, group.world_size) for mb in minis]
    per_rank = [[mini[rank] for mini in shards] for rank in range(group.world_size)]
    results = group.call_sharded("update", per_rank, denominators, **kwargs)
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}


class _timed:
    def __init__(self, timings: dict[str, float], phase: str):
        self.timings, self.phase = timings, phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timings[f"timing/{self.phase}_s"] = time.perf_counter() - self.start


# ----------------------------------------------------------------------------- the job


def train_from_store(
    store: "RolloutStore",
    cfg: TrainConfig,
    out_dir: Path,
    *,
    split: str = "train",
    steps: tuple[int | None, int | None] | None = None,
    max_ratio: float = 2.0,
    epochs: int = 1,
) -> dict[str, Any]:
    """Train the configured policy (``model.path``, else the tiny model) on every stored step
    of ``split`` in ``steps``, ``epochs`` times, on Ray worker groups as ``agentrl train`` does.
    Writes ``metrics.jsonl``, ``policy/`` (when ``trainer.export_hf``) and returns a summary."""
    import json
    import os

    import ray
    from transformers import AutoTokenizer

    from agentrl.replay.store import TrajectoryFilter
    from agentrl.trainer.logging import MetricsLogger
    from agentrl.trainer.run import resolve_model
    from agentrl.trainer.workers import ActorWorker, CriticWorker, ReferenceWorker, WorkerGroup, init_local_ray, worker_env

    where = TrajectoryFilter(split=split, steps=steps)
    stored_steps = sorted(set(store.read_table(["step"], where).column("step").to_pylist()))
    if not stored_steps:
        raise DataError(f"no stored {split} trajectories in steps {_steps_text(steps)}", file=str(store.root))
    total = len(stored_steps) * epochs
    model_path = str(resolve_model(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    started_ray = init_local_ray()
    cpus = os.cpu_count() or 2
    env = worker_env(threads=cfg.trainer.threads_per_worker or max(1, cpus // cfg.actor.world_size))
    dist = dict(device=cfg.trainer.device, seed=cfg.trainer.seed)
    actor = WorkerGroup(ActorWorker, world_size=cfg.actor.world_size, num_cpus=0.01, env=env, name="actor",
                        model_path=model_path, config=cfg.actor, total_steps=total, temperature=cfg.rollout.temperature,
                        share_prompts=cfg.model.share_prompt_forward, **dist)
    groups = ReplayGroups(actor=actor)
    if cfg.use_reference:
        groups.reference = WorkerGroup(ReferenceWorker, world_size=cfg.actor.world_size, num_cpus=0.01, env=env, name="reference",
                                       model_path=model_path, temperature=cfg.rollout.temperature,
                                       share_prompts=cfg.model.share_prompt_forward, **dist)
    if cfg.critic.enable:
        groups.critic = WorkerGroup(CriticWorker, world_size=cfg.critic.world_size, num_cpus=0.01, env=env, name="critic",
                                    model_path=model_path, config=cfg.critic, total_steps=total,
                                    share_prompts=cfg.model.share_prompt_forward, **dist)
    kl = cfg.algorithm.kl_ctrl
    kl_ctrl = algo.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive" else algo.FixedKLController(kl.kl_coef)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLogger(out_dir, cfg.logging)
    done = 0
    last: dict[str, float] = {}
    try:
        for _ in range(epochs):
            for source_step in stored_steps:
                trajectories = list(store.iter_trajectories(TrajectoryFilter(split=split, steps=(source_step, source_step + 1))))
                last = replay_step(groups, trajectories, cfg, pad_token_id=pad_id, max_ratio=max_ratio, kl_ctrl=kl_ctrl,
                                   update_actor=done >= cfg.trainer.critic_warmup)
                last["replay/source_step"] = float(source_step)
                done += 1
                log.log(done, last)
        if cfg.trainer.export_hf:
            actor.call_all("export_hf", str(out_dir / "policy"))
    finally:
        log.close()
        for group in (groups.actor, groups.reference, groups.critic):
            if group is not None:
                group.kill()
        if started_ray:
            ray.shutdown()
    summary = {"store": str(store.root), "split": split, "source_steps": stored_steps, "updates": done, "max_ratio": max_ratio,
               "model": model_path, **{k: last[k] for k in ("logprob_mismatch/mean", "replay/ratio_mean", "replay/truncated_fraction")}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _steps_text(steps: tuple[int | None, int | None] | None) -> str:
    first, stop = steps or (None, None)
    return f"{'' if first is None else first}:{'' if stop is None else stop}"

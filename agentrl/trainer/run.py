"""``agentrl train``: multi-turn PPO / GRPO on FSDP2 workers under Ray.

One step, top to bottom (``Trainer.train_step``):

    rollout -> rewards -> old logprobs -> reference logprobs -> values -> advantages
            -> critic update -> actor update -> weight sync

The actor's rank 0 hosts the built-in engine and runs the agent loops, so rewards (trajectory
and turn rewards) come back with the trajectories. Each phase is timed; metrics go to the
console, ``metrics.jsonl`` and any other logger asked for.

With no arguments this is the quickstart (the embedded default): build the tiny model, warm it
up with SFT on generated tool-use demonstrations, measure held-out success, train with GRPO on
the calculator task, measure again, and write ``summary.json`` and ``report.html``.

Run directory: ``config.yaml`` (resolved), ``metrics.jsonl``, ``rollouts/`` (parquet, the replay
format), ``checkpoints/step_N/``, ``policy/`` (a transformers checkpoint), ``summary.json``.
``trainer.resume=<run dir>`` continues from the last checkpoint so that the following steps'
metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from agentrl.config import TrainConfig, load_config
from agentrl.errors import CheckpointError, DataError
from agentrl.trainer import algorithms as algo
from agentrl.trainer.batch import TrainBatch, collate
from agentrl.trainer.logging import MetricsLogger
from agentrl.trainer.workers import mini_batch_denominator
from agentrl.trajectory import Trajectory

__all__ = ["Trainer", "RunResult", "train", "cli_main", "trajectory_metrics", "compute_advantages"]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


# ----------------------------------------------------------------------------- pure helpers


def compute_advantages(batch: TrainBatch, cfg: TrainConfig, kl_coef: float | None) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards (with the KL penalty when asked) -> advantages and returns, per the estimator."""
    mask = batch.response_mask
    token_rewards, turn_rewards, metrics = batch.token_rewards, batch.turn_rewards, {}
    alg = cfg.algorithm
    if alg.use_kl_in_reward and batch.ref_logprobs is not None and kl_coef is not None:
        penalized, kl = algo.apply_kl_penalty(token_rewards, batch.old_logprobs, batch.ref_logprobs, mask, kl_coef, alg.kl_penalty)
        penalty = penalized - token_rewards  # (B, R), negative
        # the turn-level estimators see each turn's summed penalty in that turn's reward
        index = batch.turn_ids.clamp(min=0)
        per_turn = torch.zeros_like(turn_rewards).scatter_add_(1, index, penalty * (batch.turn_ids >= 0))
        token_rewards, turn_rewards = penalized, turn_rewards + per_turn
        metrics["kl/reward_penalty_kl"] = float(kl)
    scores = token_rewards.sum(-1)  # (B,)
    est = alg.adv_estimator
    returns = None
    if est == "gae":
        advantages, returns = algo.compute_gae(token_rewards, batch.values, mask, alg.gamma, alg.lam)
    elif est in ("grpo", "drgrpo"):
        advantages = algo.turn_level_advantages(
            turn_rewards, batch.num_turns, batch.turn_ids, mask, batch.group_index, gamma=alg.turn_gamma,
            norm_by_std=est == "grpo" and alg.norm_adv_by_std_in_grpo,
        )
    elif est == "rloo":
        advantages = algo.compute_rloo_advantages(scores, batch.group_index).unsqueeze(1) * mask
    elif est == "reinforce_plus_plus":
        advantages = algo.compute_reinforce_pp_advantages(token_rewards, mask, alg.gamma)
    elif est == "reinforce_plus_plus_baseline":
        advantages = algo.compute_reinforce_pp_baseline_advantages(scores, mask, batch.group_index)
    else:  # the schema forbids it; kept for a clear error if the two drift apart
        raise ValueError(f"unknown adv_estimator {est!r}")
    metrics["advantages/mean"] = float(algo.masked_mean(advantages, mask))
    metrics["advantages/abs_max"] = float((advantages.abs() * mask).max())
    return batch.replace(advantages=advantages, returns=returns if returns is not None else advantages), metrics


def trajectory_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    n = max(len(trajectories), 1)
    rewards = torch.tensor([t.reward for t in trajectories] or [0.0])
    m: dict[str, float] = {
        f"{prefix}reward/mean": float(rewards.mean()),
        f"{prefix}reward/std": float(rewards.std()) if len(trajectories) > 1 else 0.0,
        f"{prefix}success_rate": float((rewards >= 1.0 - 1e-6).float().mean()),
        f"{prefix}turns/mean": sum(t.metrics.get("turns", 0.0) for t in trajectories) / n,
        f"{prefix}tool_calls/mean": sum(t.metrics.get("tool_calls", 0.0) for t in trajectories) / n,
        f"{prefix}response_length/mean": sum(len(t.response_ids) for t in trajectories) / n,
    }
    turn_rewards = [x.reward for t in trajectories for x in t.turns if x.role == "assistant" and x.reward is not None]
    if turn_rewards:
        m[f"{prefix}turn_reward/mean"] = sum(turn_rewards) / len(turn_rewards)
        m[f"{prefix}turn_reward/count"] = float(len(turn_rewards))
    for t in trajectories:
        m[f"{prefix}finish/{t.finish_reason}"] = m.get(f"{prefix}finish/{t.finish_reason}", 0.0) + 1.0 / n
        for key, value in t.metrics.items():
            if key.startswith("tool_errors/"):
                m[f"{prefix}{key}"] = m.get(f"{prefix}{key}", 0.0) + value
    # the retry task: success at the second attempt (first answer judged wrong, second right)
    second = [t for t in trajectories if sum(1 for x in t.turns if x.role == "user") >= 1]
    if second:
        m[f"{prefix}retry/second_attempt_success"] = sum(1 for t in second if t.reward >= 1.0 - 1e-6) / len(second)
    return m


def _pad_rows(batch: TrainBatch, multiple: int) -> TrainBatch:
    """Append loss-free copies of row 0 so the row count divides ``multiple`` (for sharding)."""
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch
    filler = batch.select([0] * extra).replace(response_mask=torch.zeros_like(batch.response_mask[:extra]))
    return TrainBatch.concat([batch, filler])


def _shards(batch: TrainBatch, world_size: int) -> list[TrainBatch]:
    padded = _pad_rows(batch, world_size)
    return [padded.shard(rank, world_size) for rank in range(world_size)]


def _explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    var = algo.masked_var(returns, mask)
    return float(1 - algo.masked_var(returns - values, mask) / var) if var > 0 else 0.0


@contextmanager
def _timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing/{phase}_s"] = time.perf_counter() - start


def _seed_for(seed: int, step: int, purpose: str) -> int:
    return zlib.crc32(f"{seed}|{step}|{purpose}".encode()) & 0x7FFFFFFF


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, *, log: MetricsLogger):
        from agentrl.data.dataset import RowDataset
        from agentrl.trainer.workers import ActorWorker, CriticWorker, ReferenceWorker, WorkerGroup, init_local_ray, worker_env

        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.model_path = str(resolve_model(cfg))
        self.train_files, val_rows = prepare_data(cfg, run_dir)
        self.dataset = RowDataset(
            self.train_files, batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        self.val_rows = val_rows
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

        init_local_ray()
        cpus = os.cpu_count() or 2
        env = worker_env(threads=cfg.trainer.threads_per_worker or max(1, cpus // cfg.actor.world_size))
        dist = dict(device=cfg.trainer.device, seed=cfg.trainer.seed)
        setup = dict(
            agent=cfg.agent, rollout=cfg.rollout, reward=cfg.reward, max_response_tokens=cfg.data.max_response_length,
            max_batch_size=cfg.engine.max_batch_size, seed=cfg.trainer.seed, max_concurrency=cfg.rollout.max_concurrency,
            weight_sync="disk" if cfg.engine.weight_sync == "disk" else "memory", weights_dir=str(run_dir / "engine_weights"),
        )
        # trainer.total_epochs caps the run; written back so every later reader (LR schedule, loop, summary) agrees
        self.total_steps = cfg.trainer.total_steps = cfg.trainer.planned_steps(len(self.dataset))
        self.on_policy = (
            cfg.actor.ppo_epochs == 1
            and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
            and not cfg.algorithm.use_kl_in_reward
        )
        self.actor = WorkerGroup(
            ActorWorker, world_size=cfg.actor.world_size, num_cpus=cpus / cfg.actor.world_size * 0.5, env=env, name="actor",
            model_path=self.model_path, config=cfg.actor, total_steps=max(1, self.total_steps), rollout_setup=setup,
            gradient_checkpointing=cfg.model.gradient_checkpointing, temperature=cfg.rollout.temperature,
            share_prompts=cfg.model.share_prompt_forward, **dist,
        )
        self.start_step = 0
        resumed = cfg.trainer.resume is not None and latest_checkpoint(run_dir) is not None
        if not resumed and cfg.sft.enable and (cfg.model.path is None or cfg.sft.train_files):
            self.warm_start_sft()
        self.policy_source = self.model_path
        if (run_dir / "sft_policy").is_dir():
            self.policy_source = str(run_dir / "sft_policy")
        self.reference = None
        if cfg.use_reference:
            self.reference = WorkerGroup(
                ReferenceWorker, world_size=cfg.actor.world_size, num_cpus=0.01, env=env, name="reference",
                model_path=self.policy_source, temperature=cfg.rollout.temperature, share_prompts=cfg.model.share_prompt_forward, **dist,
            )
        self.critic = None
        if cfg.critic.enable:
            self.critic = WorkerGroup(
                CriticWorker, world_size=cfg.critic.world_size, num_cpus=0.01, env=env, name="critic",
                model_path=self.policy_source, config=cfg.critic, total_steps=max(1, self.total_steps),
                share_prompts=cfg.model.share_prompt_forward, **dist,
            )
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            algo.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive" else algo.FixedKLController(kl.kl_coef)
        )
        self.store = open_store(run_dir) if cfg.trainer.save_rollouts else None
        self.last_validation: list[Trajectory] = []
        if resumed:
            self.resume()

    # ------------------------------------------------------------------ phases
    def rollout(self, rows, *, step: int, validation: bool) -> list[Trajectory]:
        cfg = self.cfg
        n = cfg.rollout.val_n if validation else cfg.rollout.n
        return self.actor.call_rank0(
            "rollout", rows, n=n, seed=_seed_for(cfg.trainer.seed, step, "val" if validation else "train"),
            group_prefix=f"{'val' if validation else 'train'}{step}/", validation=validation, policy_version=step,
        )

    def train_step(self, step: int, rows) -> dict[str, float]:
        cfg, W = self.cfg, self.cfg.actor.world_size
        timings: dict[str, float] = {}
        start = time.perf_counter()
        with _timed(timings, "rollout"):  # generation, tools, interactions and rewards
            trajectories = self.rollout(rows, step=step, validation=False)
        usable = [t for t in trajectories if t.finish_reason != "loop_error" and t.response_ids]
        if not usable:
            reasons = sorted({f"{t.finish_reason}: {t.reward_info.get('error', '')}" for t in trajectories})
            raise DataError(f"step {step}: no trajectory produced tokens to train on ({'; '.join(reasons)[:500]})")
        if self.store is not None:
            self.store.write_step(step, trajectories, rows=rows)
        batch = collate(usable, pad_token_id=self.pad_id, max_prompt_length=cfg.data.max_prompt_length,
                        max_response_length=cfg.data.max_response_length)
        micro = cfg.actor.ppo_micro_batch_size_per_gpu
        # One mini-batch, one epoch, no KL in the reward: the update's own forward gives the old
        # logprobs (see ActorWorker.update_on_policy), one forward pass fewer per step.
        on_policy = self.on_policy and step >= cfg.trainer.critic_warmup
        if not on_policy:
            with _timed(timings, "old_logprobs"):
                parts = self.actor.call_sharded("compute_logprobs", _shards(batch, W), micro)
                old, entropy = (torch.cat([p[i] for p in parts])[: len(batch)] for i in (0, 1))
                batch = batch.replace(old_logprobs=old)
        if self.reference is not None:
            with _timed(timings, "ref_logprobs"):
                ref = torch.cat(self.reference.call_sharded("compute_logprobs", _shards(batch, W), micro))[: len(batch)]
                batch = batch.replace(ref_logprobs=ref)
        if self.critic is not None:
            with _timed(timings, "values"):
                values = self.critic.call_sharded("compute_values", _shards(batch, cfg.critic.world_size), cfg.critic.ppo_micro_batch_size_per_gpu)
                batch = batch.replace(values=torch.cat(values)[: len(batch)])
        with _timed(timings, "advantages"):
            batch, adv_metrics = compute_advantages(batch, cfg, self.kl_ctrl.value)
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with _timed(timings, "critic_update"):
                metrics.update(self._update(self.critic, batch, cfg.critic.ppo_mini_batch_size, cfg.critic.world_size, cfg.critic.ppo_epochs, loss_agg_mode=cfg.actor.loss_agg_mode))
        if on_policy:
            with _timed(timings, "actor_update"):
                denominator = mini_batch_denominator(batch.response_mask, cfg.actor.loss_agg_mode)
                parts = self.actor.call_sharded("update_on_policy", _shards(batch, W), denominator, use_kl_loss=cfg.actor.use_kl_loss)
                metrics.update({k: sum(p[0][k] for p in parts) / len(parts) for k in parts[0][0]})
                old, entropy = (torch.cat([p[i] for p in parts])[: len(batch)] for i in (1, 2))
                batch = batch.replace(old_logprobs=old)
            with _timed(timings, "weight_sync"):
                self.actor.call_all("sync_weights", step + 1)
        elif step >= cfg.trainer.critic_warmup:
            with _timed(timings, "actor_update"):
                metrics.update(self._update(self.actor, batch, cfg.actor.ppo_mini_batch_size, W, cfg.actor.ppo_epochs, use_kl_loss=cfg.actor.use_kl_loss))
            with _timed(timings, "weight_sync"):
                self.actor.call_all("sync_weights", step + 1)
        wall = time.perf_counter() - start

        mask = batch.response_mask
        mismatch = (batch.engine_logprobs - batch.old_logprobs).abs() * mask
        metrics.update(trajectory_metrics(trajectories))
        metrics.update(adv_metrics)
        metrics.update(timings)
        metrics.update(
            {
                "step": float(step),
                "entropy/mean": float(algo.masked_mean(entropy, mask)),
                "logprob_mismatch/mean": float(mismatch.sum() / mask.sum().clamp(min=1)),
                "logprob_mismatch/max": float(mismatch.max()),
                "tokens/sampled": float(mask.sum()),
                "tokens/per_s": float(batch.attention_mask.sum()) / wall,
                "trajectories/loop_errors": float(len(trajectories) - len(usable)),
                "timing/step_s": wall,
            }
        )
        if batch.ref_logprobs is not None:
            metrics["kl/policy_ref"] = float(algo.masked_mean(algo.kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1"), mask))
            if cfg.algorithm.use_kl_in_reward:
                self.kl_ctrl.update(metrics["kl/policy_ref"], len(batch))
            metrics["kl/coef"] = self.kl_ctrl.value
        if batch.values is not None:
            metrics["critic/explained_variance"] = _explained_variance(batch.returns, batch.values, mask)
            metrics["critic/values_mean"] = float(algo.masked_mean(batch.values, mask))
        return metrics

    def _update(self, group, batch: TrainBatch, mini_prompts: int, world_size: int, epochs: int, **kwargs) -> dict[str, float]:
        """Split into mini-batches (``mini_prompts`` × n trajectories), shard each over the ranks."""
        size = mini_prompts * self.cfg.rollout.n
        mode = self.cfg.actor.loss_agg_mode
        minis = [mb for _ in range(epochs) for mb in batch.split(size)]
        denominators = [mini_batch_denominator(mb.response_mask, mode) for mb in minis]
        shards = [_shards(mb, world_size) for mb in minis]
        per_rank = [[mini_shards[rank] for mini_shards in shards] for rank in range(world_size)]
        results = group.call_sharded("update", per_rank, denominators, **kwargs)
        return {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    def validate(self, step: int) -> dict[str, float]:
        if not self.val_rows:
            return {}
        trajectories = self.rollout(self.val_rows, step=step, validation=True)
        self.last_validation = trajectories
        if self.store is not None:
            self.store.write_step(step, trajectories, split="val", rows=self.val_rows)
        return trajectory_metrics(trajectories, prefix="val/")

    def warm_start_sft(self) -> None:
        from agentrl.trainer.sft import run_sft_on_actor

        run_sft_on_actor(self.actor, self.cfg, self.model_path, self.tokenizer, self.pad_id, self.log, self.run_dir)
        self.actor.call_all("reset_optimizer", self.cfg.actor.optim, max(1, self.total_steps))
        self.actor.call_all("sync_weights", 0)
        self.actor.call_all("export_hf", str(self.run_dir / "sft_policy"))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        directory = self.run_dir / "checkpoints" / f"step_{step}"
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.actor.call_all("save", str(tmp))
        if self.critic is not None:
            self.critic.call_all("save", str(tmp))
        state = {"step": step, "data": self.dataset.state_dict(), "kl_coef": self.kl_ctrl.value, "rng": torch.get_rng_state().tolist()}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)  # a checkpoint exists whole or not at all
        checkpoints = sorted((self.run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in checkpoints[: -self.cfg.trainer.max_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return directory

    def resume(self) -> None:
        directory = latest_checkpoint(self.run_dir)
        if directory is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        state = json.loads((directory / "trainer_state.json").read_text())
        self.actor.call_all("load", str(directory))
        if self.critic is not None:
            self.critic.call_all("load", str(directory))
        self.dataset.load_state_dict(state["data"])
        self.kl_ctrl.value = state["kl_coef"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        self.start_step = state["step"]
        self.actor.call_all("sync_weights", self.start_step)
        self.log.console(f"resumed from {directory} at step {self.start_step}")

    def close(self) -> None:
        import ray

        try:
            self.actor.call_all("close")  # stops the engine thread before the process goes
        except Exception:  # closing after a failure must not hide it
            pass
        for group in (self.actor, self.reference, self.critic):
            if group is not None:
                group.kill()
        if ray.is_initialized():
            ray.shutdown()


# ----------------------------------------------------------------------------- setup helpers


def require_builtin_engine(cfg: TrainConfig) -> None:
    """``train`` and ``rollout`` drive the built-in engine; say so instead of ignoring the setting."""
    from agentrl.errors import ConfigError

    if cfg.engine.backend != "builtin":
        raise ConfigError([("engine.backend", f"{cfg.engine.backend!r} is not wired into agentrl train/rollout yet; "
                            "use engine=builtin (SGLang servers work through agentrl.engines.SGLangEngine in the agent layer)")])
    if cfg.engine.weight_sync == "nccl":
        raise ConfigError([("engine.weight_sync", "nccl is for remote GPU engines, not wired into agentrl train yet; use memory or disk")])


def resolve_model(cfg: TrainConfig) -> Path:
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    from agentrl.tiny import tiny_model_dir

    return tiny_model_dir(cfg.model.tiny.size, seed=cfg.model.tiny.seed)


def prepare_data(cfg: TrainConfig, run_dir: Path):
    """Training files (validated before any compute) and validation rows."""
    from agentrl.data.dataset import parse_row, row_uid, validate_files
    from agentrl.data.io import iter_raw_rows, write_rows

    if cfg.data.train_files:
        files = list(cfg.data.train_files)
    else:
        from agentrl_data_prep.tasks import generate

        files = [str(write_rows(generate(cfg.data.task, cfg.data.task_train_size, cfg.data.seed, "train"), run_dir / "data" / "train.parquet"))]
    val_files = list(cfg.data.val_files)
    if not val_files and cfg.data.task is not None and not cfg.data.train_files:
        from agentrl_data_prep.tasks import generate

        val_files = [str(write_rows(generate(cfg.data.task, cfg.data.task_val_size, cfg.data.seed, "test"), run_dir / "data" / "val.parquet"))]
    from agentrl.plugins import PluginRegistry

    known = PluginRegistry(cfg.plugins.prefer).accepted_names("agent_loops")
    problems = validate_files(files + val_files, known_agent_names=known, default_agent=cfg.agent.default_loop)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise DataError(f"invalid data ({len(problems)} problems):\n{lines}")
    val_rows = []
    for path in val_files:
        for index, raw in iter_raw_rows(path):
            row = parse_row(raw, file=path, index=index)
            val_rows.append((row_uid(row, path, index), row))
    return files, val_rows


def open_store(run_dir: Path):
    """The run's rollout store: every training and validation step, with its dataset rows."""
    from agentrl.replay.store import RolloutStore

    return RolloutStore(run_dir / "rollouts")


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp") and (p / "trainer_state.json").is_file()]
    return max(found, key=lambda p: int(p.name.split("_")[1])) if found else None


def make_run_dir(cfg: TrainConfig) -> Path:
    if cfg.trainer.resume is not None:
        return Path(cfg.trainer.resume)
    name = cfg.trainer.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.runs_root).expanduser().resolve() / name
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{name}-{suffix}")
        suffix += 1
    run_dir.mkdir(parents=True)
    return run_dir


def train(cfg: TrainConfig) -> RunResult:
    """The whole job: setup, (SFT warm start), validation, steps, checkpoints, export, summary."""
    from tqdm.auto import tqdm

    require_builtin_engine(cfg)
    started = time.perf_counter()
    run_dir = make_run_dir(cfg)
    (run_dir / "config.yaml").write_text(_to_yaml(cfg))
    log = MetricsLogger(run_dir, cfg.logging)
    trainer = Trainer(cfg, run_dir, log=log)
    summary: dict[str, Any] = {"algorithm": cfg.algorithm.adv_estimator, "run_dir": str(run_dir)}
    try:
        if cfg.trainer.val_before_train and trainer.start_step == 0:
            before = trainer.validate(0)
            log.log(0, before)
            summary["heldout_success_before"] = before.get("val/success_rate")
        bar = tqdm(range(trainer.start_step, cfg.trainer.total_steps), desc="RL", unit="step", disable=not cfg.logging.progress,
                   initial=trainer.start_step, total=cfg.trainer.total_steps)
        metrics: dict[str, float] = {}
        for step in bar:
            rows = trainer.dataset.next_batch()
            metrics = trainer.train_step(step, rows)
            done = step + 1
            if cfg.trainer.test_freq and done % cfg.trainer.test_freq == 0 and done != cfg.trainer.total_steps:
                metrics.update(trainer.validate(done))
            log.log(done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", success=f"{metrics['success_rate']:.2f}")
            if cfg.trainer.save_freq and done % cfg.trainer.save_freq == 0:
                trainer.save(done)
        after = trainer.validate(cfg.trainer.total_steps)
        log.log(cfg.trainer.total_steps, after)
        summary["heldout_success_after"] = after.get("val/success_rate")
        if cfg.trainer.export_hf:
            trainer.actor.call_all("export_hf", str(run_dir / "policy"))
    finally:
        trainer.close()
        log.close()
    summary.update(steps=cfg.trainer.total_steps, wall_s=round(time.perf_counter() - started, 1))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(run_dir, trainer.last_validation[:6], summary, decode=trainer.tokenizer.decode)
    return RunResult(run_dir=run_dir, summary=summary)


def write_report(run_dir: Path, samples: Sequence[Trajectory], summary: dict[str, Any], *, decode=None) -> Path:
    """``report.html``: metrics over steps and a few held-out trajectories, turn by turn."""
    from agentrl.replay.report import render_report

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    path = run_dir / "report.html"
    path.write_text(render_report(rows, samples, f"agentrl run {run_dir.name}", decode=decode, summary=summary))
    return path


def _to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(json.loads(cfg.model_dump_json())))


def cli_main(argv: list[str]) -> int:
    cfg = load_config("train", argv)
    result = train(cfg)
    print(json.dumps(result.summary, indent=2))
    print(f"run directory: {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

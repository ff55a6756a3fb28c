"""``agentrl train``: multi-turn PPO / GRPO on FSDP2 workers under Ray.

One step, top to bottom (``Trainer.train_step``): a rollout, then the training step shared with
replay retraining (``agentrl/trainer/step.py``), then a weight sync:

    rollout -> rewards -> old logprobs -> reference logprobs -> values -> advantages
            -> critic update -> actor update -> weight sync

The actor's rank 0 hosts the built-in engine and runs the agent loops, so rewards (trajectory
and turn rewards) come back with the trajectories. Each phase is timed; metrics go to the
console, ``metrics.jsonl`` and any other logger asked for.

With no arguments this is the quickstart (the embedded default): build the tiny model, warm it
up with SFT on generated tool-use demonstrations, measure held-out success, train with GRPO on
the calculator task, measure again, and write ``summary.json`` and ``report.html``.

The run directory (``agentrl/rundir.py``): ``config.yaml`` (resolved), ``metrics.jsonl``,
``rollouts/`` (parquet, the replay format), ``checkpoints/step_N/``, ``policy/`` (a transformers
checkpoint), ``summary.json``, ``report.html``. ``trainer.resume=<run dir>`` continues from the
last checkpoint so that the following steps' metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.agent.families import require_exact_template
from agentrl.config import TrainConfig, load_config
from agentrl.config.inert import inert_overrides
from agentrl.config.schema import TrainerConfig
from agentrl.data.prepare import environment_dataset, prepare_data
from agentrl.data.rollout_store import RolloutStore
from agentrl.engines.guard import api_key_from_env
from agentrl.engines.managed import ManagedServers, check_engine_config
from agentrl.errors import CheckpointError, WorkerDied
from agentrl.rundir import TRAINER_STATE, RunDir, make_run_dir
from agentrl.trainer.skilled_base import ensure_model
from agentrl.trainer.algorithms.kl import AdaptiveKLController, FixedKLController
from agentrl.trainer.algorithms.recipes import dynamic_sampling_filter
from agentrl.trainer.async_driver import AsyncDriver
from agentrl.agent.families import detect_tool_parser
from agentrl.trainer.health import HealthMonitor, HealthStop, malformed_example, probe_served_policy, step_health_metrics
from agentrl.trainer.startup import StartupClock, resume_collector
from agentrl.trainer.progress import model_line, rl_line, say, workers_line
from agentrl.trainer.checkpoint_io import read_json
from agentrl.trainer.logging import MetricsLogger
from agentrl.trainer.role_policies import RolePolicies, RolesActorWorker
from agentrl.trainer.sft import run_sft_on_actor
from agentrl.trainer.step import (Groups, RolloutFailed, StepResult, TrainingStep, check_weight_versions, failure_metrics, timed,
                                  trajectory_metrics)
from agentrl.trajectory import Trajectory

__all__ = ["Trainer", "RunResult", "train", "cli_main"]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def weight_version_of(state: dict[str, Any], critic_warmup: int) -> int:
    """The engine's weight version at a checkpoint: the actor updates made so far (one a step from
    ``trainer.critic_warmup`` on); checkpoints written before the version was recorded give it
    from their step."""
    return int(state.get("weight_version", max(0, state["step"] - critic_warmup)))


def _seed_for(seed: int, step: int, purpose: str) -> int:
    return zlib.crc32(f"{seed}|{step}|{purpose}".encode()) & 0x7FFFFFFF


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    policies: RolePolicies | None = None  # the trained roles' own policies (role_policies.py), when any

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, log: MetricsLogger, startup: StartupClock | None = None):
        self.servers: ManagedServers | None = None
        self.startup = startup or StartupClock()  # train() laps the validation before step 1 and reports it
        try:
            self._setup(cfg, run_dir, log)
        except BaseException:
            # what setup started must not outlive it: servers, worker groups, and the Ray it
            # initialised (a caller in the same process could not start another run)
            self.close()
            raise

    def _setup(self, cfg: TrainConfig, run_dir: Path, log: MetricsLogger) -> None:
        from agentrl.data.dataset import RowDataset
        from agentrl.trainer.in_process import InProcessGroup, runs_in_process
        from agentrl.trainer.cluster import init_local_ray, placed, plan_groups, threads_per_worker, worker_env
        from agentrl.trainer.groups import WorkerGroup
        from agentrl.trainer.workers import ActorWorker, CriticWorker, ReferenceWorker

        self.cfg, self.run, self.log = cfg, RunDir(run_dir), log
        clock = self.startup
        say(model_line(cfg), log)
        self.model_path = str(ensure_model(cfg))
        clock.lap("model")
        say("data: preparing and checking the rows", log)
        self.train_files, val_rows = prepare_data(cfg, self.run.data, environment_rows=environment_dataset(cfg))
        self.dataset = RowDataset(
            self.train_files, batch_size=cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        self.val_rows = val_rows
        clock.lap("data")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        require_exact_template(self.tokenizer, cfg, self.model_path)  # token drift stops the run here, before the workers
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        clock.lap("tokenizer")

        # one rank per group: the groups in this process (no Ray, the model loaded once); else Ray actors
        self.in_process = runs_in_process(cfg)
        Group = InProcessGroup if self.in_process else WorkerGroup
        if not self.in_process:
            init_local_ray(cfg.trainer.ship_code)
            from agentrl.trainer.nodes import check_nodes_can_write

            check_nodes_can_write([self.run.path, self.run.checkpoints])  # before any worker loads a model
            clock.lap("ray")
        cpus = os.cpu_count() or 2
        env = worker_env(threads=threads_per_worker(cfg))
        dist = dict(device=cfg.trainer.device, seed=cfg.trainer.seed, collective_timeout_s=cfg.trainer.collective_timeout_s,
                    stacks_dir=str(run_dir), placement=cfg.trainer.placement)
        from agentrl.agent.setup import RolloutSetup

        # engine=sglang without engine.servers: this process starts the servers and owns them
        # (engines/managed.py); the actor's rank 0 drives them through SGLangEngine
        if cfg.engine.backend == "sglang" and not cfg.engine.servers:
            self.servers = ManagedServers.from_config(cfg, self.model_path, log_dir=self.run.path / "servers").start()
            clock.lap("servers")
        urls = tuple(self.servers.urls) if self.servers is not None else ()
        api_key = self.servers.api_key if self.servers is not None else api_key_from_env()
        setup = RolloutSetup.from_config(cfg, weights_dir=str(self.run.engine_weights), server_urls=urls, api_key=api_key)
        self.weight_version = 0  # the engine's weights: the version of the last sync
        self.served_version: int | None = None  # the version the engine reported holding after it (trainer/health.py)
        self.health = HealthMonitor(cfg.trainer.health, say=log.console, weight_sync=cfg.engine.weight_sync,
                                    parser=cfg.agent.tool_parser if cfg.agent.tool_parser != "auto" else
                                    f"auto ({detect_tool_parser(self.tokenizer)})")
        # trainer.total_epochs caps the run; written back so every later reader (LR schedule, loop, summary) agrees
        self.total_steps = cfg.trainer.total_steps = cfg.trainer.planned_steps(len(self.dataset))
        self.start_step = 0
        resumed = cfg.trainer.resume is not None and self.run.latest_checkpoint() is not None
        warm_start = not resumed and cfg.sft.enable and (cfg.model.path is None or cfg.sft.train_files)
        # Ray's resources: GPUs, and the bundles the groups share
        plan = {} if self.in_process else plan_groups(cfg, actor_cpus=cpus / cfg.actor.world_size * 0.5)
        say(workers_line(cfg, in_process=self.in_process), log)
        self.actor = Group(
            RolesActorWorker if "trained" in cfg.agent.roles.values() else ActorWorker,  # trained roles: an engine per policy
            world_size=cfg.actor.world_size, env=env, name="actor", **placed(plan, "actor"),
            model_path=self.model_path, config=cfg.actor, total_steps=max(1, self.total_steps), rollout_setup=setup,
            gradient_checkpointing=cfg.model.gradient_checkpointing, temperature=cfg.rollout.temperature,
            share_prompts=cfg.model.share_prompt_forward, wait=False, **dist,
        )
        if warm_start:  # the reference and critic start from the SFT policy: after it
            self.actor.wait_ready()
            resume_collector()  # the imports and the model's load are done: the SFT is work
            clock.lap("actor_workers")
            self.warm_start_sft()
            clock.lap("sft")
        self.policy_source = str(self.run.sft_policy) if self.run.sft_policy.is_dir() else self.model_path
        # the other groups load their models while the actor loads its own (no SFT in between)
        self.reference = None
        if cfg.use_reference:
            self.reference = Group(
                ReferenceWorker, world_size=cfg.actor.world_size, env=env, name="reference", **placed(plan, "reference", self.actor),
                model_path=self.policy_source, temperature=cfg.rollout.temperature, share_prompts=cfg.model.share_prompt_forward,
                wait=False, **dist,
            )
        self.critic = None
        if cfg.critic.enable:
            self.critic = Group(
                CriticWorker, world_size=cfg.critic.world_size, env=env, name="critic", **placed(plan, "critic", self.actor),
                model_path=self.policy_source, config=cfg.critic, total_steps=max(1, self.total_steps),
                share_prompts=cfg.model.share_prompt_forward, wait=False, **dist,
            )
        # the groups built since the last lap (in-process groups are built by the time they exist)
        lapped = {"actor"} if warm_start else set()
        starting = [g for g in (self.actor, self.reference, self.critic)
                    if g is not None and g.name not in lapped and (g.starting or self.in_process)]
        for group in starting:
            group.wait_ready()
        resume_collector()  # the collector paused for the process's start-up (agentrl.cli) runs again
        if starting:  # e.g. "actor_reference_workers": the groups that started together
            clock.lap("_".join(g.name for g in starting) + "_workers")
        # agent.roles.<role>=trained: an actor per role from the same policy, synced into the engine (version 0)
        self.policies = RolePolicies.start(cfg, Group, in_process=self.in_process, policy_source=self.policy_source,
                                           total_steps=self.total_steps, env=env, dist=dist, reference=self.reference,
                                           pad_token_id=self.pad_id, say=log.console)
        if self.policies is not None:
            self.policies.sync_all(self.actor)
            clock.lap("role_policies")
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive" else FixedKLController(kl.kl_coef)
        )
        self.step = TrainingStep(cfg, Groups(self.actor, self.reference, self.critic), pad_token_id=self.pad_id, kl_ctrl=self.kl_ctrl)
        # every training and validation step, with its dataset rows: the replay format
        self.store = RolloutStore(self.run.rollouts) if cfg.trainer.save_rollouts else None
        self.last_validation: list[Trajectory] = []
        # rollout.max_staleness > 0: generation runs on while the trainer trains (trainer/async_driver.py)
        self.driver = AsyncDriver(self) if cfg.rollout.max_staleness > 0 else None
        if resumed:
            self.resume()
            clock.lap("resume")

    # ------------------------------------------------------------------ phases
    def rollout(self, rows, *, step: int, validation: bool, draw: int = 0) -> list[Trajectory]:
        cfg = self.cfg
        n = cfg.rollout.val_n if validation else cfg.rollout.n
        purpose = ("val" if validation else "train") + (f".{draw}" if draw else "")  # draw: dynamic sampling's refills
        return self.actor.call_rank0(
            "rollout", rows, n=n, seed=_seed_for(cfg.trainer.seed, step, purpose),
            group_prefix=f"{purpose}{step}/", validation=validation, policy_version=self.weight_version,
        )

    def rollout_filtered(self, step: int, rows) -> tuple[list[Trajectory], list[Trajectory], list, dict[str, float]]:
        """DAPO's dynamic sampling (``algorithm.filter_groups``): groups whose rewards are all
        equal carry no advantage and are dropped; more rows are drawn and rolled out until
        ``data.train_batch_size`` groups remain or ``max_num_gen_batches`` draws were made.
        Returns the kept trajectories, every trajectory and row drawn (for the store) and the counts."""
        cfg = self.cfg
        kept: list[Trajectory] = []
        every: list[Trajectory] = []
        all_rows, drawn, dropped, draw = list(rows), 0, 0, 0
        while True:
            drawn_now = self.rollout(rows, step=step, validation=False, draw=draw)
            every += drawn_now
            usable = [t for t in drawn_now if t.response_ids]
            index = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in usable))}
            keep, counts = dynamic_sampling_filter(
                torch.tensor([t.reward for t in usable]), torch.tensor([index[t.group_id] for t in usable], dtype=torch.long)
            )
            kept += [usable[i] for i in keep.tolist()]
            drawn, dropped, draw = drawn + counts["groups_drawn"], dropped + counts["groups_dropped"], draw + 1
            groups = list(dict.fromkeys(t.group_id for t in kept))
            if len(groups) >= cfg.data.train_batch_size or draw >= cfg.algorithm.filter_groups.max_num_gen_batches:
                break
            rows = self.dataset.next_batch()
            all_rows += rows
        chosen = set(groups[: cfg.data.train_batch_size])
        metrics = {"dynamic_sampling/groups_drawn": float(drawn), "dynamic_sampling/groups_dropped": float(dropped),
                   "dynamic_sampling/gen_batches": float(draw), "dynamic_sampling/groups_kept": float(len(chosen))}
        # every group uniform even after the last draw: train on that draw (its advantages are all 0)
        return [t for t in kept if t.group_id in chosen] or usable, every, all_rows, metrics

    def train_step(self, step: int, rows) -> dict[str, float]:
        """Rollout, the training step (``trainer.step``), weight sync; the rollouts go to the store."""
        if self.driver is not None:  # asynchronous: the driver draws its own rows, ahead of the trainer
            return self.driver.train_step(step)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        sampling: dict[str, float] = {}
        with timed(timings, "rollout"):  # generation, tools, interactions and rewards
            if self.cfg.algorithm.filter_groups.enable:
                trajectories, drawn, rows, sampling = self.rollout_filtered(step, rows)
            else:
                trajectories = drawn = self.rollout(rows, step=step, validation=False)
        if self.store is not None:  # numbered as the console and metrics.jsonl number it (from 1)
            trained = {t.group_id for t in trajectories}  # dynamic sampling's filtered groups are stored marked
            dropped = {t.group_id: "filtered" for t in drawn if t.group_id not in trained}
            self.store.write_step(step + 1, drawn, rows=rows, dropped=dropped)
        everything, own = trajectories, {}
        if self.policies is not None:  # trained roles' trajectories train their own policies (role_policies.py)
            trajectories, own = self.policies.split(trajectories)
        # a RolloutFailed from here comes before any update: _train_once ends the run as a stop
        check_weight_versions(trajectories, self.weight_version, where=f"step {step + 1}")
        if self.policies is not None:  # every policy's rollout checked before any policy is updated
            self.policies.check_rollout(own, step=step)
        result = self.step.online(trajectories, step=step)
        roles_metrics = self.policies.train(self.actor, own, step=step) if self.policies is not None else {}
        sampled_by = self.weight_version
        if result.updated_actor:
            with timed(timings, "weight_sync"):
                self.sync_weights(self.weight_version + 1)  # one version an update, as in async mode
        wall = time.perf_counter() - start
        metrics = {**result.metrics, **sampling, **timings, **self.health_metrics(trajectories, result, sampled_by)}
        if self.policies is not None:  # the rewards, roles and failures of every policy's trajectories
            metrics.update({**roles_metrics, **trajectory_metrics(everything), **failure_metrics(everything)})
        metrics.update({
            "step": float(step + 1),
            "tokens/per_s": float(result.batch.attention_mask.sum()) / wall,
            "timing/step_s": wall,
        })
        return metrics

    def during(self, label: str) -> None:
        """What the job does now ("step 3", "SFT warm start"): a hang or a lost worker's error
        begins with it, so that it says when as well as which call and which ranks."""
        for name in ("actor", "reference", "critic"):  # the SFT warm start runs before the others exist
            group = getattr(self, name, None)
            if group is not None:
                group.during = label
        if self.policies is not None:
            self.policies.during(label)

    def sync_weights(self, version: int) -> None:
        self.actor.call_all("sync_weights", version)
        self.weight_version = version
        self.served_version = self.actor.call_rank0("engine_weight_version")  # what the engine says it holds now

    def health_metrics(self, trajectories: list[Trajectory], result: StepResult, version: int, *,
                       dropped_groups: int = 0) -> dict[str, float]:
        """``health/*`` of a step whose tokens the trainer scored at weight ``version`` (before
        its sync), and the versions synced and reported after it (``HealthMonitor.check`` reads them)."""
        metrics = step_health_metrics(trajectories, result.batch, version, dropped_groups=dropped_groups,
                                      estimator=self.cfg.algorithm.adv_estimator)
        self.health.example = malformed_example(trajectories)
        if result.updated_actor and self.served_version is not None:
            metrics.update({"health/synced_version": float(self.weight_version), "health/engine_version": float(self.served_version)})
            if self.driver is not None:  # asynchronous: the step's tokens are mostly older versions; probe the new one
                mismatch, tokens, versions = probe_served_policy(
                    self.actor, trajectories[0].prompt_ids, pad_token_id=self.pad_id, seed=self.weight_version,
                    micro_batch_size=self.cfg.actor.ppo_micro_batch_size_per_gpu)
                metrics.update({"health/logprob_mismatch": mismatch, "health/mismatch_tokens": float(tokens),
                                "health/weight_version": float(min(versions, default=self.weight_version))})
        return metrics

    def stop(self, stop: HealthStop, summary: dict[str, Any]) -> None:
        """A health check stopped the run: a checkpoint of the step (``trainer.resume=auto`` goes on
        from it) and the stop in the summary (and so in the report)."""
        self.save(stop.step)
        summary["stopped"] = stop.record()
        self.log.console(f"agentrl train: stopped after {stop.step} steps: {stop}")

    def validate(self, step: int) -> dict[str, float]:
        if not self.val_rows:
            return {}
        trajectories = self.rollout(self.val_rows, step=step, validation=True)
        self.last_validation = trajectories
        if self.store is not None:
            self.store.write_step(step, trajectories, split="val", rows=self.val_rows)
        return trajectory_metrics(trajectories, prefix="val/")

    def warm_start_sft(self) -> None:
        self.during("SFT warm start")
        run_sft_on_actor(self.actor, self.cfg, self.model_path, self.tokenizer, self.pad_id, self.log, self.run.path,
                         label="agentrl train: SFT warm start")
        self.actor.call_all("reset_optimizer", self.cfg.actor.optim, max(1, self.total_steps))
        self.sync_weights(0)
        self.actor.call_all("export_hf", str(self.run.sft_policy))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        extra: dict[str, Any] = {}
        with self.run.new_checkpoint(step, keep=self.cfg.trainer.max_checkpoints) as directory:
            self.actor.call_all("save", str(directory))
            if self.critic is not None:
                self.critic.call_all("save", str(directory))
            if self.policies is not None:  # each trained role's actor, and its weight version
                extra["policy_versions"] = self.policies.save(directory)
            state = {**extra, "step": step, "data": self.dataset.state_dict(), "kl_coef": self.kl_ctrl.value,
                     "rng": torch.get_rng_state().tolist(), "weight_version": self.weight_version}
            if self.driver is not None:  # asynchronous: the rows in flight, dispatched again at resume
                state["async"] = self.driver.state_dict()
            (directory / TRAINER_STATE).write_text(json.dumps(state))
        return self.run.checkpoint(step)

    def resume(self) -> None:
        directory = self.run.latest_checkpoint()
        self.during(f"resume from {directory}")
        if directory is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.run.checkpoints}")
        state = read_json(directory / TRAINER_STATE, root=self.run.path)  # checked: inside the run, plain JSON, bounded
        self.actor.call_all("load", str(directory))
        if self.critic is not None:
            self.critic.call_all("load", str(directory))
        versions = self.policies.load(directory, state.get("policy_versions")) if self.policies is not None else {}
        self.dataset.load_state_dict(state["data"])
        if self.driver is not None and "async" in state:
            self.driver.load_state_dict(state["async"])
        self.kl_ctrl.value = state["kl_coef"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        self.start_step = state["step"]
        self.sync_weights(weight_version_of(state, self.cfg.trainer.critic_warmup))
        if self.policies is not None:
            self.policies.sync_all(self.actor, versions)
        self.log.console(f"resumed from {directory} at step {self.start_step}")
        self.set_aside_superseded(directory)

    def set_aside_superseded(self, checkpoint: Path) -> None:
        """What an earlier run logged and stored after the checkpoint's step trained a policy that
        no longer exists: its metrics rows and rollout shards are moved aside (kept, not deleted),
        so that every step is in ``metrics.jsonl`` and ``rollouts/`` once, as the resumed run trains it."""
        reason = f"trainer.resume went on from {checkpoint}: steps after {self.start_step} are trained again"
        rows = self.log.rewind(self.start_step, reason=reason)
        shards = RolloutStore(self.run.rollouts).set_aside_after(self.start_step, reason=reason)
        if rows or shards:
            where = f" and {len(shards)} rollout shards in {shards[0].parent}" if shards else ""
            self.log.console(f"set aside what was logged after step {self.start_step}: {rows} rows of metrics.jsonl in "
                             f"{self.run.metrics_superseded.name}{where}")

    def close(self) -> None:
        """Stop the engine, the worker groups, the servers and Ray; safe after a setup that failed
        part-way (whatever was not created is skipped)."""
        ray = sys.modules.get("ray")  # an in-process run never imports it

        actor = getattr(self, "actor", None)
        try:
            if actor is not None and not actor.starting:  # one still starting has no engine yet: killed below
                actor.call_all("close")  # stops the engine thread before the process goes
        except Exception:  # closing after a failure must not hide it
            pass
        if self.policies is not None:
            self.policies.kill()
        for group in (actor, getattr(self, "reference", None), getattr(self, "critic", None)):
            if group is not None:
                group.kill()
        if self.servers is not None:  # before Ray goes: Ray-placed servers are stopped through their host actors
            self.servers.stop()
        if ray is not None and ray.is_initialized():
            ray.shutdown()


# ----------------------------------------------------------------------------- the job


def train(cfg: TrainConfig, *, command: str | None = None) -> RunResult:
    """The whole job: setup, (SFT warm start), validation, steps, checkpoints, export, summary. A
    lost worker (``WorkerDied``, a collective timeout) restarts every group from the last
    checkpoint, up to ``trainer.max_restarts`` times. ``command``: the command line that started
    the job, for the summary and the report's headline."""
    check_engine_config(cfg, training=True)
    started = time.perf_counter()
    run = make_run_dir(cfg)
    run.write_config(cfg)
    log = MetricsLogger(run.path, cfg.logging)
    summary: dict[str, Any] = {"algorithm": cfg.algorithm.adv_estimator, "run_dir": str(run.path)}
    if command is not None:
        summary["command"] = command
    restarts = 0
    try:
        while True:
            try:
                trainer = _train_once(cfg, run, log, summary, restarted=restarts > 0)
                break
            except WorkerDied as exc:
                checkpoint = run.latest_checkpoint()
                if restarts >= cfg.trainer.max_restarts or checkpoint is None:
                    raise
                restarts += 1
                log.console(f"agentrl train: {exc}\nrestart {restarts} of trainer.max_restarts={cfg.trainer.max_restarts}: "
                            f"every worker group starts again from {checkpoint}")
                cfg = cfg.model_copy(deep=True)
                cfg.trainer.resume = str(run.path)
    finally:
        log.close()
    steps = summary["stopped"]["step"] if "stopped" in summary else cfg.trainer.total_steps  # a health stop ends it early
    summary.update(steps=steps, restarts=restarts, wall_s=round(time.perf_counter() - started, 1))
    run.write_summary(summary)
    run.write_report(trainer.last_validation[:6], summary, decode=trainer.tokenizer.decode)
    return RunResult(run_dir=run.path, summary=summary)


def _train_once(cfg: TrainConfig, run: RunDir, log: MetricsLogger, summary: dict[str, Any], *, restarted: bool) -> Trainer:
    """One attempt: a Trainer from scratch (or from the run's last checkpoint), steps to the end,
    final validation and export; closed whatever happens."""
    from tqdm.auto import tqdm

    trainer = Trainer(cfg, run.path, log=log, startup=StartupClock(count_process=not restarted))
    try:
        if cfg.trainer.val_before_train and trainer.start_step == 0:
            say(f"validation before step 1: {len(trainer.val_rows)} held-out rows", log)
            trainer.during("validation before step 1")
            before = trainer.validate(0)
            log.log(0, before)
            summary["heldout_success_before"] = before.get("val/success_rate")
            summary["heldout_tool_use_before"] = before.get("val/tool_use_rate")
            summary.update(_by_source(before, "before"))
            trainer.startup.lap("validation_before")
        log.console(trainer.startup.line())
        counts = trainer.actor.call_rank0("parameter_counts")
        lora = cfg.actor.lora
        log.console(f"actor: {counts['actor/trainable_parameters']:,} of {counts['actor/parameters']:,} parameters train"
                    + (f" (LoRA rank {lora.rank} on {', '.join(lora.target_modules)})" if lora.rank else ""))
        if not restarted:  # the run's start-up; a restart's is on the console only
            startup = trainer.startup.metrics()
            log.log(trainer.start_step, startup)
            summary.update(startup)
            summary.update(counts)
        say(rl_line(cfg, start_step=trainer.start_step), log)
        bar = tqdm(range(trainer.start_step, cfg.trainer.total_steps), desc="RL", unit="step", disable=not cfg.logging.progress,
                   initial=trainer.start_step, total=cfg.trainer.total_steps)
        metrics: dict[str, float] = {}
        for step in bar:
            # numbered as the metrics and checkpoints are: step N is the N-th update (step_N)
            trainer.during(f"step {step + 1} of {cfg.trainer.total_steps}")
            rows = trainer.dataset.next_batch() if trainer.driver is None else None
            try:
                metrics = trainer.train_step(step, rows)
            except RolloutFailed as failed:  # before the step's update: a stop as a health check's (a
                # checkpoint of the steps done, trainer.resume goes on from it; the summary and report say why)
                trainer.stop(HealthStop(str(failed), step=step, key=failed.key, measure=failed.measure,
                                        value=failed.value), summary)
                return trainer
            done = step + 1
            if cfg.trainer.test_freq and done % cfg.trainer.test_freq == 0 and done != cfg.trainer.total_steps:
                metrics.update(trainer.validate(done))
            log.log(done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", success=f"{metrics['success_rate']:.2f}")
            try:
                trainer.health.check(done, metrics)  # warnings on the console; a stop ends the run here
                if trainer.policies is not None:
                    trainer.policies.check(done, metrics)  # each trained role's policy, on its own measures
            except HealthStop as stop:
                trainer.stop(stop, summary)
                return trainer  # no final validation or export: the stop is the run's result
            if cfg.trainer.save_freq and done % cfg.trainer.save_freq == 0:
                trainer.save(done)
        if final_validation(cfg.trainer):
            trainer.during(f"final validation after step {cfg.trainer.total_steps}")
            after = trainer.validate(cfg.trainer.total_steps)
            log.log(cfg.trainer.total_steps, after)
            summary["heldout_success_after"] = after.get("val/success_rate")
            summary["heldout_tool_use_after"] = after.get("val/tool_use_rate")
            summary.update(_by_source(after, "after"))
        if cfg.trainer.export_hf:
            trainer.actor.call_all("export_hf", str(run.policy))
            if trainer.policies is not None:
                trainer.policies.export(run.path)
    finally:
        trainer.close()
    return trainer


def final_validation(trainer: TrainerConfig) -> bool:
    """Whether the run validates after its last step: ``trainer.final_validation``, else (null)
    when it validates during training (``test_freq`` > 0)."""
    return trainer.final_validation if trainer.final_validation is not None else trainer.test_freq > 0


def _by_source(validation: dict[str, float], when: str) -> dict[str, dict[str, float]]:
    """``heldout_by_source_<when>``: each validation data source's success, when there are several;
    ``heldout_by_role_<when>``: each role's reward, in an episode of several roles (docs/roles.md)."""
    out = {}
    for name, prefix, suffix in (("source", "val/source/", "/success_rate"), ("role", "val/role/", "/reward")):
        found = {k[len(prefix):].removesuffix(suffix): v for k, v in validation.items() if k.startswith(prefix) and k.endswith(suffix)}
        if found:
            out[f"heldout_by_{name}_{when}"] = found
    return out


def cli_main(argv: list[str]) -> int:
    say("reading the config")
    cfg = load_config("train", argv)
    for override, why in inert_overrides(cfg, argv):  # before any work: a key this run would not read
        print(f"agentrl train: warning: {override} has no effect: {why}", file=sys.stderr)
    from agentrl.engines import preforked
    from agentrl.trainer.in_process import prefork_engine

    prefork_engine(cfg)  # before anything is computed here (engines/preforked.py)
    try:
        result = train(cfg, command=shlex.join(["agentrl", "train", *argv]))
    finally:
        preforked.discard()  # a child no engine took
    print(json.dumps(result.summary, indent=2))
    print(f"run directory: {result.run_dir}")
    if "stopped" in result.summary:  # a health check or the rollout's failures stopped it: not a success
        print(f"agentrl train: stopped after {result.summary['stopped']['step']} steps: {result.summary['stopped']['reason']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

"""Asynchronous training (``rollout.max_staleness`` = eta > 0): generation never waits for training.

    admit batches -> take finished groups (drop or wait on stale ones) -> train -> sync weights

The actor's rank 0 rolls out on a thread of its own (``agent/async_rollout.py``) with the
engine in a process of its own (``engines/process.py``; ``engine.process=false``: on another
thread) holding its own copy of the weights; this driver hands it batches of rows and takes back
whole groups as they finish, while the trainer trains on the main thread. A weight sync goes
through the engine's update path between steps: the engine drains the requests running at that
moment (each generate call is sampled by exactly one version; ``rollout.partial``: interrupts
them, to resume under the new weights) and the requests admitted after it run under the new version.

The rules (AReaL's, counted in groups; docs/training.md "Asynchronous training"):

* admission: a batch of ``B`` rows is dispatched while the groups dispatched stay within
  ``(eta + 1) * B`` ahead of the groups trained or dropped. Every group is dispatched whole, at
  the weight version of the moment (``dispatch_version``).
* staleness of a trained group = the weight version of the step that trains it minus the oldest
  version among its sampled tokens (queue time included). The bound is inclusive and never
  exceeded: ``stale_groups=drop`` drops a finished group over it (as a whole); ``wait`` trains
  the oldest finished groups and waits as long as the groups left (finished, or running, counted
  at their dispatch version) could not all be trained within the bound at ``B`` a step afterwards
  (earliest deadline first; the admission rule makes it feasible once everything running ends).
* each step trains exactly ``B`` groups, the oldest first; weight versions count the actor updates,
  as in the synchronous trainer (version k: the policy after k updates).
* nothing is dispatched that the run cannot train: no batch while the groups running or finished
  already fill the steps left (``trainer.total_steps``); a dropped group makes room for another.
  (Without it the last eta steps ran beside up to eta batches nobody would train, which on a
  machine without spare cores took their compute from the groups that were.)
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from agentrl.config.schema import TrainConfig
from agentrl.errors import AgentrlError
from agentrl.trainer.step import timed

if TYPE_CHECKING:
    from agentrl.agent.async_rollout import FinishedGroup

__all__ = ["AsyncDriver", "Selection", "RolloutWaitTimeout", "batches_to_admit", "select_groups", "staleness_metrics"]


class RolloutWaitTimeout(AgentrlError):
    """The trainer waited ``rollout.max_wait_s`` for finished groups and none came."""


@dataclass
class Selection:
    chosen: list[FinishedGroup] | None  # the step's groups, or None: wait for more to finish
    dropped: list[FinishedGroup] = field(default_factory=list)  # over the bound (drop mode)


def batches_to_admit(*, dispatched: int, retired: int, batch_size: int, max_staleness: int) -> int:
    """How many more batches may be dispatched: groups dispatched stay within
    ``(max_staleness + 1) * batch_size`` of the groups trained or dropped (``retired``)."""
    room = retired + (max_staleness + 1) * batch_size - dispatched
    return max(0, room // batch_size)


def select_groups(
    finished: Sequence[FinishedGroup],
    in_flight: dict[str, int],
    *,
    version: int,
    next_version: int,
    max_staleness: int,
    batch_size: int,
    mode: str,
) -> Selection:
    """The groups of the step that trains at weight ``version`` (``next_version`` after its
    update), from the ``finished`` ones; ``in_flight``: group id -> dispatch version of those
    still running. See the module docstring for the rules."""
    fresh = [g for g in finished if version - g.oldest_version <= max_staleness]
    stale = [g for g in finished if version - g.oldest_version > max_staleness]
    if mode == "drop":
        fresh.sort(key=lambda g: g.oldest_version)
        return Selection(fresh[:batch_size] if len(fresh) >= batch_size else None, stale)
    if mode != "wait":
        raise ValueError(f"rollout.stale_groups must be drop or wait, got {mode!r}")
    if stale:  # the wait rule keeps every group within the bound: this is a bug, not data
        raise AgentrlError(f"rollout.stale_groups=wait: group {stale[0].group_id} is {version - stale[0].oldest_version} "
                           f"versions old at version {version}, over rollout.max_staleness={max_staleness}")
    fresh.sort(key=lambda g: g.oldest_version)  # the earliest deadline first
    if len(fresh) < batch_size:
        return Selection(None)
    chosen, left = fresh[:batch_size], [g.oldest_version for g in fresh[batch_size:]]
    if not _fits(left, next_version, max_staleness, batch_size):
        raise AgentrlError(f"rollout.stale_groups=wait: the finished groups left after version {version} cannot all be "
                           f"trained within rollout.max_staleness={max_staleness}: the admission rule was broken")
    if not _fits(left + list(in_flight.values()), next_version, max_staleness, batch_size):
        return Selection(None)  # a running group needs one of this step's places: wait for it
    return Selection(chosen)


def _fits(versions: list[int], next_version: int, max_staleness: int, batch_size: int) -> bool:
    """Whether groups as old as ``versions`` can all be trained, ``batch_size`` a step from
    ``next_version`` on (one version a step), each by version ``its own + max_staleness``."""
    for i, v in enumerate(sorted(versions)):
        steps = v + max_staleness - next_version + 1  # the steps at versions next_version .. v + max_staleness
        if i + 1 > steps * batch_size:
            return False
    return True


def _or(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


def staleness_metrics(groups: Sequence[FinishedGroup], version: int, max_staleness: int) -> dict[str, float]:
    """Per trained trajectory: staleness mean and max and the count at each staleness 0..eta."""
    values = [version - _or(t.oldest_version, g.oldest_version) for g in groups for t in g.trajectories]
    n = max(len(values), 1)
    metrics = {"async/staleness_mean": sum(values) / n, "async/staleness_max": float(max(values, default=0))}
    metrics.update({f"async/staleness_hist/{k}": float(values.count(k)) for k in range(max_staleness + 1)})
    return metrics


class AsyncDriver:
    """One asynchronous step at a time for a ``Trainer`` (``trainer/run.py``): its dataset, actor
    group, training step, store and weight sync."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        cfg: TrainConfig = trainer.cfg
        self.eta = cfg.rollout.max_staleness
        self.mode = cfg.rollout.stale_groups
        self.batch_size = cfg.data.train_batch_size
        self.dispatched = self.retired = self.batches = 0
        self.in_flight: dict[str, int] = {}  # group id -> dispatch version
        self.rows: dict[str, tuple[str, Any]] = {}  # group id -> its (row id, row), for the store
        self.finished: list[FinishedGroup] = []
        # rows to dispatch before the dataset's next ones: those in flight at the checkpoint resumed from
        self.pending: list[tuple[str, Any]] = []
        if cfg.actor.rollout_correction.level is None:
            trainer.log.console(
                f"warning: rollout.max_staleness={self.eta} trains on samples of older policies with no off-policy "
                "correction: set actor.rollout_correction.level=token (truncated importance sampling against the "
                "engine's logprobs), with actor.rollout_correction.method=decoupled for decoupled PPO (docs/training.md)")

    def admit(self, step: int | None = None) -> None:
        """Dispatch what the admission rule allows (and, from step ``step`` on, what the run's steps
        left can train)."""
        t = self.trainer
        cfg: TrainConfig = t.cfg
        room = batches_to_admit(dispatched=self.dispatched, retired=self.retired, batch_size=self.batch_size,
                                max_staleness=self.eta)
        if step is not None:  # the groups the steps left will train, less those running or finished
            wanted = (cfg.trainer.total_steps - step) * self.batch_size - len(self.in_flight) - len(self.finished)
            room = min(room, max(0, -(-wanted // self.batch_size)))
        for _ in range(room):
            if self.pending:
                rows, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
            else:
                rows = t.dataset.next_batch()
            k = self.batches
            seed = zlib.crc32(f"{cfg.trainer.seed}|{k}|train".encode()) & 0x7FFFFFFF  # run.py's _seed_for
            ids = t.actor.call_rank0("submit_rollout", rows, n=cfg.rollout.n, seed=seed, group_prefix=f"train{k}/",
                                     version=t.weight_version)
            for group_id, row in zip(ids, rows):
                self.in_flight[group_id] = t.weight_version
                self.rows[group_id] = row
            self.batches += 1
            self.dispatched += len(ids)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records: the rows dispatched and not yet trained or dropped (in flight
        or finished and waiting), in dispatch order, and the batch counter (group ids stay unique)."""
        return {"batches": self.batches,
                "in_flight_rows": [[row_id, row.model_dump_json()] for row_id, row in [*self.rows.values(), *self.pending]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the rows in flight at the checkpoint are dispatched again first, under the
        resumed policy; nothing of theirs was trained, so nothing is trained twice."""
        from agentrl.data.row import Row

        self.batches = int(state["batches"])
        self.pending = [(row_id, Row.model_validate_json(raw)) for row_id, raw in state["in_flight_rows"]]

    def take(self, step: int) -> tuple[list[FinishedGroup], list[FinishedGroup], float]:
        """The step's groups, the groups dropped as stale meanwhile, and the seconds waited."""
        t = self.trainer
        cfg: TrainConfig = t.cfg
        version = t.weight_version
        next_version = version + 1 if step >= cfg.trainer.critic_warmup else version
        dropped: list[FinishedGroup] = []
        waited = 0.0
        since = time.monotonic()
        while True:
            self.admit(step)
            selection = select_groups(self.finished, self.in_flight, version=version, next_version=next_version,
                                      max_staleness=self.eta, batch_size=self.batch_size, mode=self.mode)
            if selection.dropped:
                gone = {g.group_id for g in selection.dropped}
                self.finished = [g for g in self.finished if g.group_id not in gone]
                self.retired += len(gone)
                dropped += selection.dropped
                continue  # the room they leave admits more rows
            if selection.chosen is not None:
                chosen = {g.group_id for g in selection.chosen}
                self.finished = [g for g in self.finished if g.group_id not in chosen]
                self.retired += len(chosen)
                return selection.chosen, dropped, waited
            if time.monotonic() - since > cfg.rollout.max_wait_s:
                raise RolloutWaitTimeout(
                    f"step {step + 1}: the trainer waited rollout.max_wait_s={cfg.rollout.max_wait_s} s for finished groups "
                    f"on the actor's rank 0: {len(self.finished)} finished, {len(self.in_flight)} in flight, "
                    f"{self.batch_size} needed (stale_groups={self.mode})")
            start = time.perf_counter()
            new = t.actor.call_rank0("finished_rollouts", min(5.0, cfg.rollout.max_wait_s))
            waited += time.perf_counter() - start
            for g in new:
                self.in_flight.pop(g.group_id, None)
            self.finished += new

    def train_step(self, step: int) -> dict[str, float]:
        """Take ``B`` finished groups, train on them, sync the weights; the trained and the dropped
        groups go to the store."""
        t = self.trainer
        timings: dict[str, float] = {}
        start = time.perf_counter()
        version = t.weight_version
        with timed(timings, "rollout"):  # here: the wait for finished groups (generation runs meanwhile)
            groups, dropped, waited = self.take(step)
        trajectories = [x for g in groups for x in g.trajectories]
        if t.store is not None:
            stored = groups + dropped  # the dropped ones marked: a reader tells them from the trained
            t.store.write_step(step + 1, [x for g in stored for x in g.trajectories],
                               rows=[self.rows[g.group_id] for g in stored], dropped={g.group_id: "stale" for g in dropped})
        for g in groups + dropped:
            self.rows.pop(g.group_id, None)
        result = t.step.online(trajectories, step=step)
        if result.updated_actor:
            with timed(timings, "weight_sync"):
                t.sync_weights(version + 1)  # one version an update (staleness counts updates)
        wall = time.perf_counter() - start
        metrics = {**result.metrics, **timings, **staleness_metrics(groups, version, self.eta),
                   **t.health_metrics(trajectories, result, version, dropped_groups=len(dropped))}
        metrics.update({
            "step": float(step + 1),
            "tokens/per_s": float(result.batch.attention_mask.sum()) / wall,
            "timing/step_s": wall,
            "async/dropped_groups": float(len(dropped)),
            "async/in_flight_groups": float(len(self.in_flight)),
            "async/trainer_idle_fraction": waited / wall,
        })
        # the engine's busy fraction and the requests a sync interrupted and resumed, since the last step
        metrics.update(t.actor.call_rank0("engine_stats"))
        return metrics

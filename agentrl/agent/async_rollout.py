"""Rollouts that keep running while the trainer trains (asynchronous training, docs/training.md).

``BackgroundRollout`` owns an asyncio event loop on a thread of its own: the agent loops, tools
and interactions run there, the built-in engine steps in a process of its own
(``agentrl.engines.process.EngineProcess``, so no engine step holds this loop), and the caller
(the trainer's actor, rank 0) is free to train. Batches of rows are submitted with the weight version they were
dispatched at; each group (the ``n`` samples of one row) comes back as one ``FinishedGroup``
when its last sample ends, never split. The caller takes finished groups as they come
(``finished``), waiting at most the time it names.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Sequence, TypeVar

from agentrl.agent.runner import RolloutRunner
from agentrl.data.row import Row
from agentrl.engines.base import REQUEST_PRIORITY
from agentrl.errors import AgentrlError
from agentrl.trajectory import Trajectory

__all__ = ["BackgroundRollout", "FinishedGroup", "RolloutLost"]

T = TypeVar("T")


class RolloutLost(AgentrlError):
    """A submitted batch failed as a whole (not one trajectory: those come back with their error)."""


@dataclass(slots=True)
class FinishedGroup:
    """The ``n`` trajectories of one row (a loop with roles: ``n`` per role), dispatched together at ``dispatch_version``."""

    group_id: str
    dispatch_version: int
    trajectories: list[Trajectory]  # in sample order

    @property
    def oldest_version(self) -> int:
        """The oldest engine weight version among the group's sampled tokens (the dispatch version
        when no token was sampled)."""
        found = [t.oldest_version for t in self.trajectories if t.oldest_version is not None]
        return min(found) if found else self.dispatch_version


class BackgroundRollout:
    """A rollout runner on an event loop running on a daemon thread (see the module docstring)."""

    def __init__(self, runner: RolloutRunner, *, loop: asyncio.AbstractEventLoop | None = None):
        self.runner = runner
        self.loop = loop or asyncio.new_event_loop()
        self._cv = threading.Condition()
        self._done: list[FinishedGroup] = []
        self._errors: list[BaseException] = []
        self._in_flight: dict[str, int] = {}  # group id -> trajectories still running
        self._submitted = 0  # batches submitted: each batch's engine requests go before a later one's
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentrl-rollout", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet finished."""
        with self._cv:
            return len(self._in_flight)

    def submit(self, rows: Sequence[tuple[str, Row]], *, n: int, seed: int, group_prefix: str, version: int) -> list[str]:
        """Start ``n`` samples of every row (one group each) without waiting; returns the group ids."""
        ids = [f"{group_prefix}{i}:{row_id}" for i, (row_id, _) in enumerate(rows)]
        parts: dict[str, list[Trajectory]] = {g: [] for g in ids}
        samples: dict[str, set[int]] = {g: set() for g in ids}  # the samples of each group that have ended
        with self._cv:
            for g in ids:
                self._in_flight[g] = n
        priority, self._submitted = self._submitted, self._submitted + 1

        def finish(g: str) -> None:
            with self._cv:
                del self._in_flight[g]
                members = sorted(parts.pop(g), key=lambda x: x.sample_index)
                self._done.append(FinishedGroup(g, version, members))
                self._cv.notify_all()

        def on_done(t: Trajectory) -> None:  # on the rollout thread
            t.policy_version = version
            # a loop with roles (agentrl.agent.roles) hands on a trajectory per role, in <group>@<role>,
            # one after another with no wait between them: the row's group holds them all
            g = t.group_id.rsplit("@", 1)[0] if t.role is not None else t.group_id
            parts[g].append(t)
            if t.sample_index not in samples[g]:
                samples[g].add(t.sample_index)
                if len(samples[g]) == n:  # whole once the last sample's other roles are in: on the loop's next turn
                    self.loop.call_soon(finish, g)

        async def run() -> None:
            # the oldest batch first in the engine's queue: its groups end first (the trainer
            # waits for them), the later batches' turns fill what room is left in each engine step
            REQUEST_PRIORITY.set(priority)
            try:
                await self.runner.run(rows, n=n, seed=seed, group_prefix=group_prefix, on_done=on_done)
            except BaseException as exc:  # noqa: BLE001 - handed to the taker, never lost
                with self._cv:
                    self._errors.append(exc)
                    for g in ids:
                        self._in_flight.pop(g, None)
                    self._cv.notify_all()

        asyncio.run_coroutine_threadsafe(run(), self.loop)
        return ids

    def finished(self, *, wait_s: float, who: str = "the trainer") -> list[FinishedGroup]:
        """The groups finished since the last call; waits up to ``wait_s`` for the first one when
        there is none (an empty list after the wait: the caller decides whether that is an error).
        A batch that failed as a whole raises ``RolloutLost`` naming ``who`` waited."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while not self._done and not self._errors:
                left = deadline - time.monotonic()
                if left <= 0 or not self._in_flight:
                    break
                self._cv.wait(left)
            if self._errors:
                exc = self._errors.pop(0)
                raise RolloutLost(f"{who}: a batch of rollouts failed as a whole: {type(exc).__name__}: {exc}") from exc
            done, self._done = self._done, []
        return done

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        """Run a coroutine on the rollout loop from another thread and wait for it (validation)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        """Cancel what is running and stop the loop's thread."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(30)
        except Exception:  # closing must not hide the failure that led here
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

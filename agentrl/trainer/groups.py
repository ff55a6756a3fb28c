"""``WorkerGroup``: the ranks of one worker class started as Ray actors in a placement group,
meeting in one process group (gloo on CPU, NCCL on GPU), and called together.

A call that some ranks finished and others did not within the collective timeout raises
``CollectiveTimeout`` naming the group, the call and the ranks, with the stacks they wrote.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from agentrl.errors import WorkerDied
from agentrl.trainer.rank import Worker

__all__ = ["CollectiveTimeout", "DEFAULT_COLLECTIVE_TIMEOUT_S", "WorkerGroup"]


# trainer.collective_timeout_s's default (the schema's): long enough for a slow CPU step's gaps
# between collectives, short of NCCL's and gloo's own defaults (10 and 30 minutes).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


# What the driver adds to the collective timeout before it gives up on a rank: the rank's stack
# dump fires at the timeout, and the file must be written.
_STACK_GRACE_S = 3.0


# The least time the ranks of a group get to start (``WorkerGroup``'s first call).
_START_TIMEOUT_S = 600.0


class CollectiveTimeout(WorkerDied):
    """Some ranks of a group did not finish a call within the collective timeout of the others:
    a hang (ranks making different collectives, a rank stuck) turned into an error."""


# Calls whose rank 0 keeps working alone after the collective part (writing a checkpoint, loading
# an engine): the other ranks' early answers do not start the clock on rank 0.
_RANK0_TAIL = frozenset({"save", "export_hf", "sync_weights", "close", "engine_stats"})


class WorkerGroup:
    """``world_size`` Ray actors of one worker class forming one process group.

    No wait is unbounded while ranks disagree: a call that some ranks finished (or failed) and
    others did not within ``collective_timeout_s`` (plus a few seconds for the stack dump) raises
    ``CollectiveTimeout``, naming the group, the call and the ranks, with the stacks those ranks
    wrote under ``stacks_dir`` (see ``Worker.call``). Their collectives time out too (the
    process group's timeout), so ranks that all wait on each other fail as well. ``None``: no
    timeout at all (the process group's default)."""

    def __init__(self, cls: type, *, world_size: int, num_cpus: float, env: dict[str, str], name: str,
                 collective_timeout_s: float | None = DEFAULT_COLLECTIVE_TIMEOUT_S, stacks_dir: str | None = None,
                 placement: str = "PACK", wait: bool = True, num_gpus: float = 0.0,
                 bundle: dict[str, float] | None = None, colocate_with: "WorkerGroup | None" = None, **kwargs: Any):
        """``wait=False``: return once the ranks are spawned, so that several groups load their
        models at the same time; ``wait_ready()`` then waits for them (every call does too).

        Each rank takes ``num_cpus`` and ``num_gpus`` from its placement-group bundle. The group
        reserves one ``bundle`` per rank (default: the rank's own CPUs and GPUs), or, with
        ``colocate_with``, runs rank r in that group's bundle r: on GPUs a bundle is one device,
        so colocated ranks share their rank's GPU by fractions (Ray gives a rank that asks for no
        GPU every device of its node, and every rank would pick the first)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.world_size = name, world_size
        self.timeout_s = collective_timeout_s
        self._watched = issubclass(cls, Worker)  # other classes (test stand-ins) are called plainly
        # stack files of calls in flight (removed when a call returns); by default in the temp dir
        # under names of this driver's own
        self.stacks_dir = Path(stacks_dir) if stacks_dir else Path(tempfile.gettempdir())
        self._stacks_prefix = name if stacks_dir else f"agentrl-{os.getpid()}-{name}"
        self.broken: str | None = None  # set by a timeout: the ranks' collectives no longer line up
        # what the driver is doing ("step 3", "start-up"): errors begin with it, so that a hang or
        # a lost worker says when it happened as well as in which call (set by the driver)
        self.during = "start-up"
        # One bundle per rank, on one node where it fits (PACK) or over several (SPREAD); the
        # process group meets at rank 0's node, whose address and free port are asked there.
        start_wait = max(self.timeout_s or _START_TIMEOUT_S, _START_TIMEOUT_S)
        self.owns_placement = colocate_with is None
        if colocate_with is not None:
            if colocate_with.world_size != world_size:
                raise ValueError(f"{name} group: {world_size} ranks cannot share the {colocate_with.world_size} bundles of {colocate_with.name}")
            self.placement = colocate_with.placement
        else:
            reserve = bundle or {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
            self.placement = placement_group([dict(reserve)] * world_size, strategy=placement)
            ready, _ = ray.wait([self.placement.ready()], timeout=start_wait)
            if not ready:
                ray.util.remove_placement_group(self.placement)
                wanted = ", ".join(f"{v:g} {k}" for k, v in reserve.items())
                raise CollectiveTimeout(f"{self.during}: {name} group: {world_size} ranks of {wanted} could not be placed ({placement}) "
                                        f"within {start_wait:g} s: the cluster has not the free resources")
        in_bundle = [PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r) for r in range(world_size)]
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": env})(cls)

        def spawn() -> None:
            meeting = ray.remote(_rendezvous).options(scheduling_strategy=in_bundle[0], num_cpus=0)
            master_addr, port = ray.get(meeting.remote(), timeout=start_wait)
            self.workers = [
                remote.options(name=None, scheduling_strategy=in_bundle[rank]).remote(
                    rank=rank, world_size=world_size, master_addr=master_addr, master_port=port,
                    collective_timeout_s=collective_timeout_s, **kwargs)
                for rank in range(world_size)
            ]
            self._starting = [self._remote(r, "ready") for r in range(world_size)]

        self._spawn = spawn
        self._starting: list[Any] | None = None
        try:
            spawn()
            if wait:
                self.wait_ready()
        except BaseException:  # a group that failed to start leaves no ranks or bundles behind
            self.workers = getattr(self, "workers", [])
            self.kill()
            raise

    @property
    def starting(self) -> bool:
        """Spawned with ``wait=False`` and not waited for yet."""
        return self._starting is not None

    def wait_ready(self) -> "WorkerGroup":
        """Wait until every rank has started. The ranks must all start (and join the process group)
        within the timeout: a rank that cannot be placed (no free CPU or GPU left in the cluster)
        is an error, not a wait."""
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            starting, self._starting = self._starting, None
            if starting is None:
                break
            try:
                self._collect("ready", starting, from_start=True)
            except WorkerDied as exc:
                # rank 0's free port was taken by another process between the rendezvous picking
                # it and the process group binding it: the ranks start again on a new one
                if self.world_size == 1 or "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS:
                    raise
                import ray

                for worker in self.workers:
                    ray.kill(worker)
                self._spawn()
        return self

    def stacks_file(self, rank: int) -> Path:
        return self.stacks_dir / f"{self._stacks_prefix}-rank{rank}-stacks.txt"

    def _remote(self, rank: int, method: str, *args: Any, **kwargs: Any):
        if not self._watched:
            return getattr(self.workers[rank], method).remote(*args, **kwargs)
        return self.workers[rank].call.remote(method, str(self.stacks_file(rank)), *args, **kwargs)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank; returns each rank's result."""
        return self._collect(method, [self._remote(r, method, *args, **kwargs) for r in range(self.world_size)])

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Rank r gets ``shards[r]`` as its first argument."""
        if len(shards) != self.world_size:
            raise ValueError(f"{self.name}.{method}: {len(shards)} shards for {self.world_size} ranks")
        return self._collect(method, [self._remote(r, method, s, *args, **kwargs) for r, s in enumerate(shards)])

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A call on rank 0 alone (a rollout): no collective, so no timeout here."""
        self.wait_ready()
        return self.get([getattr(self.workers[0], method).remote(*args, **kwargs)])[0]

    def get(self, refs: list[Any]) -> list[Any]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDied(f"{self.during}: a worker of the {self.name} group died: {exc}") from exc

    def _collect(self, method: str, refs: list[Any], from_start: bool = False) -> list[Any]:
        """Every rank's answer to ``method``; once one rank has answered, the others get
        ``timeout_s`` (and a grace for their stack dumps) to answer too (``from_start``: every
        rank gets ``timeout_s`` from now)."""
        import ray

        if not from_start:
            self.wait_ready()  # a group spawned with wait=False: its start-up errors come first

        if self.broken is not None:
            raise CollectiveTimeout(f"{self.during}: {self.name} group: not calling `{method}`, the group is broken ({self.broken})")
        if self.timeout_s is None:
            return self.get(refs)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, answered, failed = set(refs), {}, {}
        # starting takes longer than any collective: processes, imports and weights on a loaded machine
        deadline = time.monotonic() + max(self.timeout_s, _START_TIMEOUT_S) if from_start else None
        while pending:
            clocked = [r for r in pending if not (method in _RANK0_TAIL and rank_of[r] == 0)]
            wait = None if deadline is None or not clocked else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not done:
                missing = sorted(rank_of[r] for r in pending)
                stacks = [str(self.stacks_file(r)) for r in range(len(refs)) if self.stacks_file(r).is_file()]
                finished = sorted(answered)
                errors = "".join(f"\n  rank {rank} failed: {str(error).strip().splitlines()[-1][:300]}" for rank, error in sorted(failed.items()))
                self.broken = f"`{method}` timed out"
                raise CollectiveTimeout(
                    f"{self.during}: {self.name} group: `{method}` hangs: rank(s) {missing} of {self.world_size} did not answer within "
                    + (f"{max(self.timeout_s, _START_TIMEOUT_S):g} s of their start." if from_start else
                       f"{self.timeout_s:g} s of rank(s) {sorted(finished + list(failed))} (trainer.collective_timeout_s).")
                    + f"{errors}\n  Python stacks of the ranks in the call: "
                    + (", ".join(stacks) if stacks else f"none written under {self.stacks_dir} (a rank that never started?)")
                )
            for ref in done:
                pending.discard(ref)
                try:
                    answered[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(f"{self.during}: a worker of the {self.name} group died in `{method}`: {exc}") from exc
                except Exception as exc:  # the rank's own error: raised once every rank answered or timed out
                    failed[rank_of[ref]] = exc
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s + _STACK_GRACE_S
        if failed:
            raise failed[min(failed)]
        return [answered[rank] for rank in range(len(refs))]

    def node_ids(self) -> list[str]:
        """The Ray node each rank runs on."""
        import ray

        return self.get([w.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()) for w in self.workers])

    def kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        if self.owns_placement:  # a colocated group's bundles go with the group that reserved them
            ray.util.remove_placement_group(self.placement)


_PORT_ATTEMPTS = 3  # a group's start when another process took rank 0's port: rare, and never twice in a row


def _rendezvous() -> tuple[str, int]:
    """(this node's address, a free port on it): where the process group of a group meets."""
    import ray

    from agentrl.trainer.dist import free_port

    return ray.util.get_node_ip_address(), free_port()

"""A one-rank worker group in the driver's own process: the same worker classes and calls as
``WorkerGroup``, without Ray.

A job whose groups all have one rank needs no process of its own per group: no collective to
time out, no peer to place, no node to lose. Starting Ray and a worker process that imports
torch and loads the model again cost more than the training of a short run on a CPU
(docs/benchmarks.md, the trainer race's end-to-end times); in the driver the model loads once
and the first step starts at once (``trainer.workers``: ``auto`` chooses this path for such jobs).

What stays as with Ray: arguments and results are copies (Ray passes values, and code on either
side may change what it holds), every call runs under the worker's stack watchdog (a call
longer than the collective timeout writes its stack to the run directory), and a worker's error
reaches the driver as that error. What differs: a rank cannot die alone (its errors are the
driver's), so ``trainer.max_restarts`` has nothing to restart.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["InProcessGroup", "runs_in_process", "prefork_engine"]


def runs_in_process(cfg: Any) -> bool:
    """``trainer.workers`` for a training config: ``auto`` is in-process when every group has
    one rank, the job joins no cluster (``RAY_ADDRESS``), no server is placed by Ray and no
    restart is asked for (``trainer.max_restarts``: restarting needs worker processes to lose)."""
    if cfg.trainer.workers != "auto":
        return cfg.trainer.workers == "local"
    return (not cfg.groups_of_several_ranks() and not os.environ.get("RAY_ADDRESS") and cfg.engine.placement != "ray"
            and cfg.trainer.max_restarts == 0)


def prefork_engine(cfg: Any) -> bool:
    """Fork the built-in engine's process now (``engines/preforked.py``) when this run will start
    one from this process: the built-in engine in a process of its own (``engine.process``, by
    default in asynchronous training) beside an actor in this process. For ``agentrl train``, after
    reading the config and before anything else; returns whether a child now waits."""
    from agentrl.engines import preforked

    own_process = cfg.engine.process if cfg.engine.process is not None else cfg.rollout.max_staleness > 0
    if cfg.engine.backend != "builtin" or not own_process or not runs_in_process(cfg):
        return False
    return preforked.prefork()


class InProcessGroup:
    """``world_size`` must be 1: the one rank is an instance of ``cls`` in this process."""

    def __init__(self, cls: type, *, world_size: int, env: dict[str, str], name: str,
                 collective_timeout_s: float | None = None, stacks_dir: str | None = None, **kwargs: Any):
        if world_size != 1:
            raise ValueError(f"{name} group: {world_size} ranks cannot run in the driver's process (one rank only)")
        # WorkerGroup's placement arguments mean nothing in one process
        for key in ("placement", "wait"):
            kwargs.pop(key, None)
        self.name, self.world_size = name, 1
        self.during = "start-up"
        self.stacks_dir = Path(stacks_dir) if stacks_dir else None
        threads = env.get("OMP_NUM_THREADS")
        if threads:  # the worker processes' OMP_NUM_THREADS, applied to this process's torch
            torch.set_num_threads(int(threads))
        import torch.distributed as dist

        # the first group makes the one-rank process group the others join; a group the caller
        # had made before (a notebook's, a test's) is theirs to keep
        self._owns_process_group = not dist.is_initialized()
        try:
            self.worker = cls(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                              collective_timeout_s=collective_timeout_s, **kwargs)
        except BaseException:  # a rank that failed to start leaves no process group behind
            self.worker = None
            self.kill()
            raise

    starting = False  # the rank is built when the group is

    def wait_ready(self) -> "InProcessGroup":
        return self

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = copy.deepcopy((args, kwargs))
        if self.stacks_dir is None or not hasattr(self.worker, "call"):
            result = getattr(self.worker, method)(*args, **kwargs)
        else:
            stacks = self.stacks_dir / f"{self.name}-rank0-stacks.txt"
            result = self.worker.call(method, str(stacks), *args, **kwargs)
        return copy.deepcopy(result)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._call(method, *args, **kwargs)]

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if len(shards) != 1:
            raise ValueError(f"{self.name}.{method}: {len(shards)} shards for 1 rank")
        return [self._call(method, shards[0], *args, **kwargs)]

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._call(method, *args, **kwargs)

    def kill(self) -> None:
        """Drop the rank and the process group it made (a later run in this process makes its own)."""
        import torch.distributed as dist

        self.worker = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

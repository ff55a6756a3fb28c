"""Before the first step: every node of the Ray cluster can write the run directory.

Rank 0 of each group writes checkpoints from its own node and every rank reads them back on
resume, so a node that does not see the run directory (no shared storage mounted, read-only)
would fail only at the first save, after the compute is spent. A zero-CPU task pinned to each
alive node writes and removes a probe file in the run and checkpoint directories; the error
names every node that could not, with its address and the reason."""

from __future__ import annotations

import os
from pathlib import Path

from agentrl.errors import CheckpointError

__all__ = ["check_nodes_can_write"]

# a node that cannot even run a zero-CPU task within this time is reported, not waited on
_PROBE_TIMEOUT_S = 120.0


def _probe(directories: list[str]) -> str | None:
    """On one node: None when every directory can be created and written there, else why not."""
    for directory in directories:
        probe = Path(directory) / f".agentrl-write-probe-{os.getpid()}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            return f"cannot write {directory}: {exc}"
    return None


def check_nodes_can_write(directories: list[Path], timeout_s: float = _PROBE_TIMEOUT_S) -> None:
    """Raise ``CheckpointError`` naming each alive node of the connected Ray cluster that cannot
    write every one of ``directories``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_probe)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
        .remote([str(d) for d in directories]): n
        for n in nodes
    }
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    problems = []
    for ref in ready:
        try:
            reason = ray.get(ref)
        except Exception as exc:  # the task itself failed on that node (its environment, its disk)
            reason = f"the write check failed: {str(exc).strip().splitlines()[-1][:300]}"
        if reason is not None:
            problems.append((refs[ref], reason))
    problems += [(refs[ref], f"did not run the write check within {timeout_s:g} s") for ref in late]
    if problems:
        lines = "".join(f"\n  node {n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')}): {why}" for n, why in problems)
        raise CheckpointError(
            f"{len(problems)} of {len(nodes)} Ray node(s) cannot write the run directory; every node needs it on "
            f"shared storage (docs/cluster.md, Shared storage):{lines}"
        )

"""Offline replay of multi-turn rollouts: store, show, report, re-score, re-train, re-run.

Importable from here (these modules load pyarrow but not torch)::

    from agentrl.replay import RolloutStore, TrajectoryFilter, render_report, ReplayEngine, rerun_trajectories

* ``RolloutStore`` (``agentrl.data.rollout_store``) - parquet shards per (split, step, writer),
  atomic, filtered reads; the trainer and ``agentrl rollout`` write it, so it sits below them;
* ``render_report`` (``agentrl.report``) - the static HTML report (plots over steps, trajectories);
* ``rescore``: new rewards from another reward plugin into a new store;
* ``train``: updates from stored trajectories with truncated importance ratios (imports torch,
  so it is not re-exported here: ``from agentrl.replay.train import ...``);
* ``rerun``: ``ReplayEngine`` and ``rerun_trajectories`` - stored trajectories back through their loops;
* ``cli``: ``agentrl replay show | report | rescore | train | rerun``.
"""

from __future__ import annotations

from agentrl.data.rollout_store import SCHEMA_VERSION, RolloutStore, StoredTrajectory, TrajectoryFilter
from agentrl.replay.rerun import Difference, ReplayEngine, RerunResult, compare_trajectories, rerun_trajectories
from agentrl.replay.rescore import rescore_store, rescore_trajectory
from agentrl.report import render_report

__all__ = [
    "RolloutStore",
    "StoredTrajectory",
    "TrajectoryFilter",
    "SCHEMA_VERSION",
    "render_report",
    "rescore_store",
    "rescore_trajectory",
    "ReplayEngine",
    "RerunResult",
    "Difference",
    "compare_trajectories",
    "rerun_trajectories",
]

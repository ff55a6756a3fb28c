"""Offline replay of multi-turn rollouts: store, show, report, re-score, re-train, re-run.

Importable from here (lazily: ``import agentrl.replay`` loads neither pyarrow nor torch)::

    from agentrl.replay import RolloutStore, TrajectoryFilter, render_report, ReplayEngine, rerun_trajectories

* ``RolloutStore`` (``agentrl.data.rollout_store``) - parquet shards per (split, step, writer),
  atomic, filtered reads; the trainer and ``agentrl rollout`` write it, so it sits below them;
* ``render_report`` (``agentrl.report``) - the static HTML report (plots over steps, trajectories);
* ``rescore``: new rewards from another reward plugin into a new store;
* ``train``: updates from stored trajectories with truncated importance ratios;
* ``rerun``: ``ReplayEngine`` and ``rerun_trajectories`` - stored trajectories back through their loops;
* ``cli``: ``agentrl replay show | report | rescore | train | rerun``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "RolloutStore": "agentrl.data.rollout_store",
    "StoredTrajectory": "agentrl.data.rollout_store",
    "TrajectoryFilter": "agentrl.data.rollout_store",
    "SCHEMA_VERSION": "agentrl.data.rollout_store",
    "render_report": "agentrl.report",
    "rescore_store": "agentrl.replay.rescore",
    "rescore_trajectory": "agentrl.replay.rescore",
    "ReplayEngine": "agentrl.replay.rerun",
    "RerunResult": "agentrl.replay.rerun",
    "Difference": "agentrl.replay.rerun",
    "compare_trajectories": "agentrl.replay.rerun",
    "rerun_trajectories": "agentrl.replay.rerun",
    "truncated_importance_weights": "agentrl.replay.train",
    "replay_step": "agentrl.replay.train",
    "train_from_store": "agentrl.replay.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

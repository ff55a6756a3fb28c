"""Offline replay of multi-turn rollouts: store, show, report, re-score, re-train, re-run.

Importable from here (lazily: ``import agentrl.replay`` loads neither pyarrow nor torch)::

    from agentrl.replay import RolloutStore, TrajectoryFilter, render_report, ReplayEngine, rerun_trajectories

* ``store``: ``RolloutStore`` - parquet shards per (split, step, writer), atomic, filtered reads;
* ``report``: ``render_report`` - the static HTML report (plots over steps, trajectories);
* ``rescore``: new rewards from another reward plugin into a new store;
* ``train``: updates from stored trajectories with truncated importance ratios;
* ``rerun``: ``ReplayEngine`` and ``rerun_trajectories`` - stored trajectories back through their loops;
* ``cli``: ``agentrl replay show | report | rescore | train | rerun``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "RolloutStore": "agentrl.replay.store",
    "StoredTrajectory": "agentrl.replay.store",
    "TrajectoryFilter": "agentrl.replay.store",
    "SCHEMA_VERSION": "agentrl.replay.store",
    "render_report": "agentrl.replay.report",
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

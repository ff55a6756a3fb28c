"""The code a job ships to the Ray nodes it joins: agentrl and the plugins the driver sees.

On a cluster that agentrl joins (``RAY_ADDRESS``), the other nodes run whatever Python
environment they were started with. Rather than asking every node to have the driver's exact
checkout and plugins installed, the job's runtime environment carries them: Ray uploads the
``py_modules`` once per content hash and every node unpacks them ahead of its own site-packages,
so a worker imports the driver's agentrl and the driver's plugins. Entry points are package
metadata, which shipped modules do not carry, so the driver's plugin table travels too
(``PLUGIN_TABLE_ENV``, read by ``agentrl.plugins``): every node resolves a plugin name to the
same ``module:attribute`` as the driver. Third-party libraries (torch, transformers, a plugin's
own dependencies) are not shipped: the nodes need them installed (docs/cluster.md).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from agentrl.plugins import PLUGIN_TABLE_ENV, discover

__all__ = ["shipped_modules", "job_runtime_env", "should_ship"]

# compiled files and caches are rebuilt on the node; they only cost upload time
_EXCLUDES = ["__pycache__", "*.pyc", ".pytest_cache"]


def _location(top_level: str) -> str | None:
    """The directory of package ``top_level`` (or the file of a single-module plugin)."""
    spec = importlib.util.find_spec(top_level)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return str(Path(spec.origin).resolve()) if spec.origin and spec.origin.endswith(".py") else None


def shipped_modules(staging: Path) -> list[str]:
    """agentrl's package and the top-level package of every plugin entry point the driver sees,
    each once (a namespace package's first location). A node imports a shipped directory by its
    own name, so a package whose directory is named otherwise (agentrl's built-in plugins:
    ``agent_loops/`` is imported as ``agentrl_agent_loops``) is copied under ``staging`` by its
    import name first."""
    tops = ["agentrl"] + [spec.target.split(":")[0].split(".")[0] for spec in discover()]
    paths: list[str] = []
    for top in dict.fromkeys(tops):
        path = _location(top)
        if path is not None and Path(path).is_dir() and Path(path).name != top:
            path = str(shutil.copytree(path, staging / top, ignore=shutil.ignore_patterns(*_EXCLUDES)))
        if path is not None and path not in paths:
            paths.append(path)
    return paths


def plugin_table() -> str:
    """The driver's plugin table as the workers read it back (``agentrl.plugins``)."""
    return json.dumps([spec.as_dict() for spec in discover()])


def should_ship(mode: str, joining: bool) -> bool:
    """``trainer.ship_code``: ``auto`` ships when joining a running cluster (a private one is this
    machine, whose environment the workers already share)."""
    return mode == "always" or (mode == "auto" and joining)


def job_runtime_env(staging: Path) -> dict[str, Any]:
    """The job-level runtime environment that ships the code: every task and actor of the job
    inherits it (worker groups add their own environment variables on top). ``staging``: a
    directory for renamed copies, needed until Ray has uploaded them (``ray.init``)."""
    return {"py_modules": shipped_modules(staging), "excludes": list(_EXCLUDES),
            "env_vars": {PLUGIN_TABLE_ENV: plugin_table()}}

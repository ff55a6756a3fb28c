"""``init_local_ray`` starts a private cluster whatever an earlier Ray left behind.

A killed Ray session leaves ``$TMPDIR/ray/ray_current_cluster``; Ray's own address lookup (and
its scan for running Ray processes, other users' included) then makes ``ray.init(num_cpus=...)``
try to join a cluster and fail. Both run in a child process with a temp dir of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

STALE_ADDRESS = "127.0.0.1:6399"  # nothing listens there: the dead session's GCS

STARTS_A_JOB = """
import ray
from agentrl.trainer.cluster import init_local_ray
assert init_local_ray() is True
print("nodes", len(ray.nodes()), "answer", ray.get(ray.remote(lambda: 41 + 1).remote()))
ray.shutdown()
"""
RAYS_DEFAULT_LOOKUP = """
import ray
ray.init(num_cpus=1, include_dashboard=False)
"""


def run_child(code: str, temp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["TMPDIR"] = str(temp)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_a_stale_cluster_file_changes_nothing():
    # a short directory: Ray's unix socket paths must stay under 108 characters
    with tempfile.TemporaryDirectory(prefix="ray-stale-") as temp:
        (Path(temp) / "ray").mkdir()
        (Path(temp) / "ray" / "ray_current_cluster").write_text(STALE_ADDRESS + "\n")
        control = run_child(RAYS_DEFAULT_LOOKUP, Path(temp))  # what a plain ray.init does with that file
        assert control.returncode != 0
        assert "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" in control.stderr
        done = run_child(STARTS_A_JOB, Path(temp))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == "nodes 1 answer 42"

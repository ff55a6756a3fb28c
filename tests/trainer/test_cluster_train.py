"""`agentrl train` on a Ray cluster it joins (``RAY_ADDRESS``): three nodes of a
``ray.cluster_utils.Cluster`` on this machine (a head without CPUs for the driver, two nodes
with one CPU each, so that the two actor ranks run on the two nodes, STRICT_SPREAD).

The run uses a reward plugin that only the driver can import (its package and entry point are
on the driver's ``sys.path``, not in the environment the nodes were started with), so it works
only if the job ships its code and plugin table to the nodes (``trainer.ship_code``): with
``never`` the run fails naming the plugin; by default it trains and checkpoints every step.
Then the second node is removed mid-run: the run ends with an error naming the step and the lost
worker (not a hang), its checkpoints intact; with a replacement node, the same command with
``trainer.resume=auto`` continues from the last checkpoint to the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

STEPS = 5  # the lost node goes after step 2: steps 3 to 5 are the resumed run's
FLOOR = 0.25  # the plugin's reward for a wrong answer: the built-in gives 0


def _plugin(root: Path) -> Path:
    """A distribution with one reward entry point, importable only from ``root``."""
    package = root / "shipped_floor_reward"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(f"""
        from agentrl.rewards import gsm8k_flexible

        def reward(data_source, solution, ground_truth, extra_info=None):
            return {FLOOR} + {1 - FLOOR} * gsm8k_flexible(data_source, solution, ground_truth)
    """))
    info = root / "shipped_floor_reward-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shipped-floor-reward\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[agentrl.rewards]\nshipped_floor = shipped_floor_reward:reward\n")
    return root


def _train(address: str, plugin: Path, runs: Path, *extra: str) -> subprocess.Popen:
    # the driver alone puts the plugin on its path; the nodes' workers get what the job ships
    launcher = f"import sys; sys.path.insert(0, {str(plugin)!r}); from agentrl.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [
        "train", "sft.enable=false", f"trainer.total_steps={STEPS}", "actor.world_size=2", "trainer.placement=STRICT_SPREAD",
        "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.save_freq=1",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.threads_per_worker=1", "trainer.export_hf=false",
        "rollout.max_new_tokens=16", "data.max_response_length=64", "data.task_val_size=2", "logging.progress=false",
        "reward.default=shipped_floor", "trainer.collective_timeout_s=60", f"trainer.runs_root={runs}",
        "trainer.run_name=cluster", *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RAY_ADDRESS"] = address
    return subprocess.Popen([sys.executable, "-c", launcher, *args], cwd=runs, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _steps(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r for r in rows if "reward/mean" in r}


@pytest.mark.timeout(540)
def test_train_on_a_cluster_ships_its_plugins_survives_a_lost_node_and_resumes(tmp_path):
    from ray.cluster_utils import Cluster

    plugin = _plugin(tmp_path / "plugin")
    runs = tmp_path / "runs"
    runs.mkdir()
    run = runs / "cluster"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        cluster.add_node(num_cpus=1)
        second = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()

        # without the shipped code the nodes do not know the driver's plugin
        unshipped = _train(cluster.address, plugin, runs, "trainer.ship_code=never", "trainer.run_name=unshipped")
        out, _ = unshipped.communicate(timeout=240)
        assert unshipped.returncode != 0 and "no plugin named 'shipped_floor'" in out, out[-3000:]

        job = _train(cluster.address, plugin, runs)
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_2").is_dir():  # a complete checkpoint (renamed whole)
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 300 s"
            time.sleep(0.05)
        cluster.remove_node(second)
        lost = time.monotonic()
        out, _ = job.communicate(timeout=200)
        assert job.returncode != 0, out[-3000:]
        assert time.monotonic() - lost < 90  # an error within the collective timeout, not a hang
        # the first call that needs a rank on the lost node (the reference's or the actor's) says so
        assert re.search(rf"step \d of {STEPS}: a worker of the (actor|reference) group died", out), out[-3000:]
        before = _steps(run)
        assert 2 <= max(before) < STEPS
        # the plugin scored on the nodes: its floor, where the built-in scores a wrong answer 0
        assert all(row["reward/mean"] >= FLOOR - 1e-9 for row in before.values())

        cluster.add_node(num_cpus=1)  # a healthy cluster again
        cluster.wait_for_nodes()
        resumed = _train(cluster.address, plugin, runs, "trainer.resume=auto")
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out[-3000:]
        last = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
        assert last == STEPS
        assert "resumed from" in out and "at step " in out, out[-3000:]
        after = _steps(run)
        assert sorted(after) == list(range(1, STEPS + 1))
        assert all(row["reward/mean"] >= FLOOR - 1e-9 for row in after.values())
    finally:
        cluster.shutdown()

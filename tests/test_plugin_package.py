"""The example plugin package of docs/plugins.md (examples/plugin_package), as a user ships it:
built as a wheel, installed beside agentrl's wheel in a fresh virtual environment, then listed,
smoke-tested with the scripted engine and trained with for two steps.

The fresh environment reads the test environment's dependencies (torch, transformers, ray, ...)
through a .pth file instead of downloading them again; agentrl and the plugin package are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from wheels import REPO, agentrl_wheel, build_wheel

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "plugin_package"
OURS = {("agentrl.tools", "shout"), ("agentrl.interactions", "loudness"), ("agentrl.agent_loops", "shout_twice"),
        ("agentrl.rewards", "loud"), ("agentrl.data_source_rewards", "shout/words")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    wheels = [agentrl_wheel(root / "dist"), build_wheel(EXAMPLE, root / "dist")]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
                           *map(str, wheels)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_AUTH_MODE")}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_the_fresh_environment_runs_its_own_agentrl_and_lists_the_packages_plugins(venv, tmp_path):
    where = run(venv, "python", "-c", "import agentrl, agentrl_shout; print(agentrl.__file__); print(agentrl_shout.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout  # installed, not the checkout
    listed = run(venv, "agentrl", "plugins", "list", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    mine = {(p["group"], p["name"]) for p in json.loads(listed.stdout) if p["distribution"] == "agentrl-shout"}
    assert mine == OURS
    checked = run(venv, "agentrl", "plugins", "list", "--check", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_custom_loop_runs_from_a_script_without_a_model(venv, tmp_path):
    rows = tmp_path / "rows.parquet"
    assert run(venv, "python", "-m", "agentrl_shout.data", str(rows), "--rows", "2", "--loop", "shout_twice", cwd=tmp_path).returncode == 0
    # row 0 answers quietly, is told to be louder and shouts; row 1 shouts at once
    (tmp_path / "script.jsonl").write_text('{"row": "shout/words:0", "answers": ["hello", "HELLO"]}\n'
                                           '{"row": "shout/words:1", "answers": ["AGENT"]}\n')
    done = run(venv, "agentrl", "rollout", "engine=scripted", "engine.script=script.jsonl", f"data.train_files=[{rows}]",
               "rollout.n=1", "trainer.runs_root=runs", "trainer.run_name=smoke", "logging.progress=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    read = ("from agentrl.data.rollout_store import RolloutStore; import json\n"
            "for t in RolloutStore('runs/smoke/rollouts').iter_trajectories():\n"
            "    print(json.dumps([t.row_id, t.agent_name, t.reward, [m['content'] for m in t.messages[1:]], t.metrics['loop/second_answers']]))")
    shown = run(venv, "python", "-c", read, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    got = sorted(json.loads(line) for line in shown.stdout.splitlines())
    assert got == [["shout/words:0", "shout_twice", 1.0, ["hello", "Louder, please.", "HELLO"], 1.0],
                   ["shout/words:1", "shout_twice", 1.0, ["AGENT"], 0.0]]  # scored by the package's own data-source reward


def test_two_training_steps_with_the_packages_loop_and_data_source_reward(venv, tmp_path):
    rows = tmp_path / "rows.parquet"
    assert run(venv, "python", "-m", "agentrl_shout.data", str(rows), "--rows", "8", "--loop", "shout_twice", cwd=tmp_path).returncode == 0
    done = run(venv, "agentrl", "train", f"data.train_files=[{rows}]", "sft.enable=false",
               "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false",
               "trainer.export_hf=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
               "rollout.max_new_tokens=8", "data.max_response_length=64", "logging.progress=false",
               "trainer.runs_root=runs", "trainer.run_name=train", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in map(json.loads, (tmp_path / "runs" / "train" / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the untrained model never answers in capitals: the loop asks again (its metric reaches the
    # step's metrics) and the package's reward for its data source gives 0
    assert all(r["loop/second_answers"] > 0.5 and r["turns/mean"] > 1.5 and r["reward/mean"] == 0.0 for r in steps), steps

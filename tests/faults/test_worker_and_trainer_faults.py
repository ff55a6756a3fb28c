"""Faults survived: a worker process that dies mid-step is named, not waited on forever; a
trainer (PPO with a critic and adaptive KL) killed with SIGKILL resumes from its last checkpoint
with an uninterrupted run's metrics, the killed run's rows and shards after that checkpoint set aside."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.data.rollout_store import RolloutStore

pytestmark = pytest.mark.ray

SHORT = [
    "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=0", "trainer.final_validation=true", "trainer.max_checkpoints=3",
    "trainer.val_before_train=false", "trainer.export_hf=false",
    "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
    "data.task_train_size=32", "data.task_val_size=8", "rollout.max_new_tokens=32", "data.max_response_length=96",
    "sft.num_demos=32", "sft.epochs=1", "logging.progress=false", "actor.optim.lr=1e-3",
    # rewards that differ within a group (any number 0.5, the right one 1): the policy moves, so
    # the resumed run's metrics can only match if the optimizer and weights were restored
    "reward.default=gsm8k_flexible", "reward.format_score=0.5",
    # the untrained tiny model, not the quickstart's calculator-skilled base, which answers every
    # question of a group alike
    "model.tiny.skills=none", "rollout.temperature=0.7",
]


class Sleeper:
    def __init__(self, **kwargs):
        self.rank = kwargs["rank"]

    def ready(self):
        return self.rank

    def pid(self):
        return os.getpid()

    def work(self, seconds):
        time.sleep(seconds)
        return "done"


def test_a_worker_that_dies_mid_call_is_named():
    import ray

    from agentrl.errors import WorkerDied
    from agentrl.trainer.groups import WorkerGroup

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}  # so workers import this module
        group = WorkerGroup(Sleeper, world_size=2, num_cpus=0.5, env=env, name="actor")
        pids = group.call_all("pid")
        refs = [w.work.remote(30) for w in group.workers]
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)  # the process dies, as an OOM kill would do it
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="a worker of the actor group died"):
            group.get(refs)
        assert time.monotonic() - start < 25  # reported, not waited out
    finally:
        ray.shutdown()


def metrics(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "reward/mean" in row:
            out[row["step"]] = row  # the last record of a step wins (a resumed run rewrites it)
    return out


def run(args, cwd, log: Path, **popen):
    """The run's output goes to a file: a pipe nobody reads fills up (Ray's logs are long) and
    blocks the run on its next write."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, text=True, **popen)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


# PPO with what a PPO checkpoint holds beyond GRPO's: the critic (weights, optimizer) and the
# adaptive KL coefficient (KL in the reward); GRPO's resume is tests/trainer/test_train_run.py's
PPO = SHORT + [
    "algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.target_kl=0.001", "algorithm.kl_ctrl.horizon=10",
]


def test_trainer_killed_with_sigkill_resumes_ppo_with_the_same_metrics(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    reference = run(PPO + [f"trainer.runs_root={tmp_path}", "trainer.run_name=straight"], tmp_path, logs / "straight.txt")
    assert reference.wait(timeout=600) == 0, tail(logs / "straight.txt")
    killed_dir = tmp_path / "killed"
    victim = run(PPO + [f"trainer.runs_root={tmp_path}", "trainer.run_name=killed"], tmp_path, logs / "killed.txt",
                 start_new_session=True)
    deadline = time.monotonic() + 600
    while not (killed_dir / "checkpoints" / "step_2" / "trainer_state.json").is_file():
        assert victim.poll() is None, tail(logs / "killed.txt")
        assert time.monotonic() < deadline, "the run to be killed wrote no step_2 checkpoint in 600 s"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)  # the driver, Ray and its workers, mid-run
    victim.wait()
    # as if the kill had come while step 2's checkpoint was written (after step 2 was logged and
    # stored): what an interrupted write leaves, which resume skips
    for checkpoint in (killed_dir / "checkpoints").glob("step_*"):
        if checkpoint.name != "step_1":
            checkpoint.rename(checkpoint.with_name(checkpoint.name + ".tmp"))
    killed_steps = [json.loads(line)["step"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()
                    if "reward/mean" in line]
    assert killed_steps[:2] == [1, 2], killed_steps
    # the same command again with trainer.resume=auto: it finds the killed run's last checkpoint
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *PPO, f"trainer.runs_root={tmp_path}",
                           "trainer.run_name=killed", "trainer.resume=auto"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    straight, resumed = metrics(tmp_path / "straight"), metrics(killed_dir)
    assert sorted(resumed) == [1, 2, 3]
    # each step once in metrics.jsonl and the store, as the resumed run trained it; the killed
    # run's rows and shards of the steps after step_1 are set aside, not lost
    trained = [row["step"] for row in map(json.loads, (killed_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in row]
    assert trained == [1, 2, 3]
    superseded = [json.loads(line) for line in (killed_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [row["step"] for row in superseded if "reward/mean" in row] == killed_steps[1:]
    assert all(f"{killed_dir / 'checkpoints' / 'step_1'}" in row["superseded_reason"] for row in superseded)
    assert RolloutStore(killed_dir / "rollouts").steps("train") == [1, 2, 3]
    [aside] = (killed_dir / "rollouts" / "superseded").iterdir()
    assert "train-step000002-w000.parquet" in {p.name for p in aside.iterdir()}
    assert "set aside what was logged after step 1: " in done.stderr
    # the policy moved: the comparison below sees the update, not a run that never trains
    assert all(straight[step]["reward/std"] > 0 and straight[step]["actor/grad_norm"] > 0 for step in straight), straight
    assert all(straight[step]["kl/policy_ref"] != 0 for step in (2, 3)), straight  # k1 to the reference may be < 0
    coefs = [straight[step]["kl/coef"] for step in (1, 2, 3)]
    assert coefs[0] != 0.05 and len(set(coefs)) == 3, coefs  # the controller moved the coefficient every step
    assert all(straight[step]["critic/grad_norm"] > 0 for step in (1, 2, 3)), straight
    for step in (2, 3):
        assert {"kl/coef", "critic/vf_loss", "critic/grad_norm", "critic/values_mean"} <= set(straight[step])
        for key, value in straight[step].items():
            if not key.startswith(("timing/", "tokens/per_s")):
                assert resumed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)


def _descendants_named(root: int, prefix: str) -> list[int]:
    """Processes under ``root`` whose command line (Ray's process title) starts with ``prefix``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                if (Path("/proc") / str(pid) / "cmdline").read_bytes().startswith(prefix.encode()):
                    found.append(pid)
            except OSError:
                pass
    return found


def _kill_the_actor_worker_after(victim: subprocess.Popen, checkpoint: Path, log: Path, *, not_pid: int | None = None) -> int:
    """SIGKILL the run's one actor worker (not ``not_pid``, a worker already killed) once
    ``checkpoint`` is written; returns its pid."""
    deadline = time.monotonic() + 400
    while True:
        assert victim.poll() is None, tail(log)
        assert time.monotonic() < deadline, f"no {checkpoint.name} checkpoint with a live actor worker in 400 s"
        workers = [pid for pid in _descendants_named(victim.pid, "ray::ActorWorker") if pid != not_pid]
        if (checkpoint / "trainer_state.json").is_file() and workers:
            assert len(workers) == 1, workers  # actor.world_size=1
            os.kill(workers[0], signal.SIGKILL)
            return workers[0]
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_a_training_worker_killed_mid_run_restarts_the_groups_then_ends_the_run_naming_the_step(tmp_path):
    """The real actor worker gets SIGKILL after step 1 with trainer.max_restarts=1: the error names
    the step and the group, every group starts again from step 1's checkpoint and the run goes
    on; the restarted worker killed after step 2 ends the run (no hang, no restart left) with an
    error naming the step, and the checkpoints stay."""
    run_dir, log = tmp_path / "lost", tmp_path / "lost.txt"
    victim = run(SHORT + [f"trainer.runs_root={tmp_path}", "trainer.run_name=lost", "trainer.max_restarts=1"], tmp_path, log,
                 start_new_session=True)
    try:
        first = _kill_the_actor_worker_after(victim, run_dir / "checkpoints" / "step_1", log)
        _kill_the_actor_worker_after(victim, run_dir / "checkpoints" / "step_2", log, not_pid=first)
        victim.wait(timeout=120)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    output = log.read_text()
    assert victim.returncode != 0, tail(log)
    # the first loss: named, then the restart from step 1's checkpoint
    assert re.search(r"step [23] of 3: a worker of the actor group died", output), tail(log)
    assert f"restart 1 of trainer.max_restarts=1: every worker group starts again from {run_dir / 'checkpoints' / 'step_1'}" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_1'} at step 1" in output
    # the second loss ends the run (step 3 running, or its final validation on a fast machine)
    assert re.search(r"(step 3 of 3|final validation after step 3): a worker of the actor group died", output.split("restart 1 of")[1]), tail(log)
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} >= {"step_1", "step_2"}


class FailsOnRankOne(Sleeper):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.rank == 1:
            raise RuntimeError("rank 1 cannot load its model")


def test_a_group_that_fails_to_start_leaves_no_ranks_or_bundles_behind():
    import ray
    from ray._private import state

    from agentrl.trainer.groups import WorkerGroup

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}  # so workers import this module
        with pytest.raises(Exception, match="rank 1 cannot load its model"):
            WorkerGroup(FailsOnRankOne, world_size=2, num_cpus=0.5, env=env, name="actor")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = [a for a in state.actors().values() if a["State"] != "DEAD"]
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
            if not alive and not groups:
                break
            time.sleep(0.2)
        assert alive == [] and groups == []  # rank 0, which started, and both bundles are gone
    finally:
        ray.shutdown()

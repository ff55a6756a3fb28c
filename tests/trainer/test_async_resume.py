"""Issue 36, item 6: an asynchronous run killed with rows in flight resumes without losing or
repeating a prompt. Real processes: ``agentrl train`` in a subprocess (one rank, in the driver's
process), SIGKILLed once a checkpoint records rows in flight, then ``trainer.resume``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from agentrl.data.rollout_store import RolloutStore
from agentrl.rundir import RunDir

ROWS, BATCH = 8, 2
STEPS = ROWS // BATCH  # one epoch
ARGS = [
    "trainer.total_epochs=1", "trainer.total_steps=100", f"data.task_train_size={ROWS}", "data.task_val_size=2",
    f"data.train_batch_size={BATCH}", "rollout.n=2", f"actor.ppo_mini_batch_size={BATCH}", "actor.ppo_micro_batch_size_per_gpu=4",
    "sft.enable=false", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.export_hf=false",
    "trainer.save_freq=1", f"trainer.max_checkpoints={STEPS}", "logging.progress=false",
    # the calculator-skilled base calls the tool on every row; each call waits about half a second,
    # so groups are still running when a step's checkpoint is written
    "+agent.tool_config.calculator.latency_median_s=0.5", "+agent.tool_config.calculator.latency_p99_s=1.0",
    "rollout.max_staleness=1", "rollout.stale_groups=wait", "actor.rollout_correction.level=token",
]


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}, "OMP_NUM_THREADS": "1"}


def _in_flight_checkpoint(run: Path) -> tuple[int, dict] | None:
    """The newest complete checkpoint whose trainer state records rows in flight."""
    found = None
    for state_file in (run / "checkpoints").glob("step_*/trainer_state.json"):
        if state_file.parent.name.endswith(".tmp"):  # being written (it appears whole, renamed)
            continue
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):  # being written
            continue
        if state.get("async", {}).get("in_flight_rows") and (found is None or state["step"] > found[0]):
            found = (state["step"], state)
    return found


def _session(sid: int) -> list[str]:
    """The command lines of the processes left in session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # the session id, after state, ppid and pgrp
                found.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def _kill_after_a_checkpoint_with_rows_in_flight(args: list[str], run: Path, cwd: Path) -> tuple[int, dict, int]:
    """Start the run in a session of its own, SIGKILL its driver process once a checkpoint records
    rows in flight; returns that checkpoint's step and state, and the session."""
    log = (cwd / "killed.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=cwd, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (found := _in_flight_checkpoint(run)) is None:
            assert proc.poll() is None, f"the run ended before a checkpoint recorded rows in flight:\n{(cwd / 'killed.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint with rows in flight after 120 s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # the driver dies at once: no close, no final checkpoint
        proc.wait(timeout=30)
        found = _in_flight_checkpoint(run)  # a later step's checkpoint may have landed meanwhile
        assert found is not None
    except BaseException:
        _end_session(proc.pid)
        raise
    finally:
        log.close()
    assert proc.returncode == -signal.SIGKILL
    return found[0], found[1], proc.pid


def _end_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_sigkilled_async_run_resumes_training_every_prompt_of_the_epoch_exactly_once(tmp_path):
    run = tmp_path / "runs" / "killed"
    args = ARGS + [f"trainer.runs_root={tmp_path / 'runs'}", "trainer.run_name=killed"]
    step, state, killed = _kill_after_a_checkpoint_with_rows_in_flight(args, run, tmp_path)
    latest = RunDir(run).latest_checkpoint()  # what trainer.resume takes
    assert latest is not None and latest.name == f"step_{step}" and step < STEPS, f"killed after {latest}: nothing left to resume"
    pending = [row_id for row_id, _ in state["async"]["in_flight_rows"]]
    logged_after = [r["step"] for r in RunDir(run).read_metrics() if "reward/mean" in r and r["step"] > step]
    first_batch = state["async"]["batches"]  # the resumed run numbers its batches from here

    try:
        done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args, f"trainer.resume={run}"], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=300)
        # the killed driver's engine process noticed and ended by itself meanwhile: nothing orphaned
        left = _session(killed)
    finally:
        _end_session(killed)
    assert not left, f"left running after the driver was killed: {left}"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{step}'} at step {step}" in done.stdout + done.stderr

    # metrics.jsonl has each step once, the resumed run's; the killed run's rows after the
    # checkpoint (if it logged any before the kill) are set aside
    assert [r["step"] for r in RunDir(run).read_metrics() if "reward/mean" in r] == list(range(1, STEPS + 1))
    aside = RunDir(run).metrics_superseded
    assert [r["step"] for r in map(json.loads, aside.read_text().splitlines() if aside.is_file() else [])
            if "reward/mean" in r] == logged_after

    # the store holds what trained each step: steps up to the checkpoint from the killed run, the
    # rest written again by the resumed one
    store = RolloutStore(run / "rollouts")
    assert store.steps("train") == list(range(1, STEPS + 1))
    groups: dict[str, list] = defaultdict(list)
    for t in store.iter_trajectories(split="train"):
        groups[t.group_id].append(t)
    trained = [members[0].row_id for members in groups.values()]
    assert all(len(members) == 2 and len({m.row_id for m in members}) == 1 for members in groups.values())
    assert len(trained) == STEPS * BATCH and sorted(set(trained)) == sorted(trained), sorted(trained)  # once each
    assert sorted(trained) == sorted(f"agentrl/arith:{i}" for i in range(ROWS))  # every row of the epoch

    # the rows in flight at the checkpoint were dispatched again first, in their order, as the
    # resumed run's first batches
    redispatched = sorted((int(g.split("/")[0].removeprefix("train")), int(g.split("/")[1].split(":")[0]), m[0].row_id)
                          for g, m in groups.items() if int(g.split("/")[0].removeprefix("train")) >= first_batch)
    assert [row_id for _, _, row_id in redispatched[: len(pending)]] == pending
    assert {b for b, _, _ in redispatched[: len(pending)]} == set(range(first_batch, first_batch + -(-len(pending) // BATCH)))
    before = {members[0].row_id for g, members in groups.items() if int(g.split("/")[0].removeprefix("train")) < first_batch}
    assert not before & set(pending)  # none of them had trained before the kill
    # the run's report draws each step's staleness histogram, once a step
    page = (run / "report.html").read_text()
    assert len(re.findall(r'<rect class="bar" data-key="async/staleness_hist/0"', page)) == STEPS

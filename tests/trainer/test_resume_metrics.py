"""A run killed after its last checkpoint and resumed trains the steps after that checkpoint
again: what the killed run logged and stored for them is set aside (kept, not deleted), so that
``metrics.jsonl`` and ``rollouts/`` hold each step once, as the resumed run trained it. The two
end-to-end resumes (sync PPO and async) assert the same on real runs:
tests/faults/test_worker_and_trainer_faults.py and tests/trainer/test_async_resume.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from agentrl.config.schema import LoggingConfig
from agentrl.data.rollout_store import RolloutStore
from agentrl.rundir import RunDir
from agentrl.trainer.logging import MetricsLogger
from agentrl.trainer.run import Trainer
from agentrl.trajectory import Trajectory

AT = "2026-11-27T04:00:00Z"


def trajectory(step: int, reward: float) -> Trajectory:
    return Trajectory(row_id=f"row{step}", group_id=f"train{step}/0:row{step}", sample_index=0, data_source="src",
                      agent_name="tool_agent", prompt_ids=[1, 2], response_ids=[3], response_mask=[1], logprobs=[-0.5],
                      turns=[], messages=[], finish_reason="stop", reward=reward)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def killed_run(run: Path) -> None:
    """What a run killed during step 6, after its step-3 checkpoint, leaves: SFT warm-start rows
    (negative steps), its start-up row and the validation before step 1 (step 0), steps 1..5, half
    of step 6's row, and rollout shards of steps 1..5 with validation at 3 and 5."""
    log = MetricsLogger(run, LoggingConfig(loggers=[]))
    log.log(-1, {"sft/loss": 2.0})
    log.log(0, {"startup/total_s": 9.0})
    log.log(0, {"val/success_rate": 0.1})
    for step in range(1, 6):
        log.log(step, {"reward/mean": step / 10})
    log.close()
    with RunDir(run).metrics.open("a") as f:
        f.write('{"step": 6, "reward/me')  # SIGKILL mid-write
    store = RolloutStore(RunDir(run).rollouts)
    for step in range(1, 6):
        store.write_step(step, [trajectory(step, step / 10)])
    for step in (3, 5):
        store.write_step(step, [trajectory(step, 0.5)], split="val")


def test_the_rows_after_the_checkpoint_step_move_to_the_superseded_file_with_time_and_reason(tmp_path):
    killed_run(tmp_path)
    run = RunDir(tmp_path)
    assert run.set_aside_metrics_after(3, reason="resumed at step 3", at=AT) == 3
    assert lines(run.metrics) == [
        {"step": -1, "sft/loss": 2.0}, {"step": 0, "startup/total_s": 9.0}, {"step": 0, "val/success_rate": 0.1},
        {"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}, {"step": 3, "reward/mean": 0.3}]
    stamp = {"superseded_at": AT, "superseded_reason": "resumed at step 3"}
    assert lines(run.metrics_superseded) == [
        {"step": 4, "reward/mean": 0.4, **stamp}, {"step": 5, "reward/mean": 0.5, **stamp},
        {"unreadable": '{"step": 6, "reward/me', **stamp}]
    # a second resume from the same checkpoint finds nothing more to move; a later one appends
    assert run.set_aside_metrics_after(3, reason="again", at=AT) == 0
    assert run.set_aside_metrics_after(1, reason="at 1", at=AT) == 2
    assert [r["step"] for r in lines(run.metrics)] == [-1, 0, 0, 1]
    assert [(r.get("step"), r["superseded_reason"]) for r in lines(run.metrics_superseded)][3:] == [(2, "at 1"), (3, "at 1")]


def test_the_logger_appends_after_the_kept_rows_once_rewound(tmp_path):
    killed_run(tmp_path)
    log = MetricsLogger(tmp_path, LoggingConfig(loggers=[]))  # the resumed process opens metrics.jsonl first
    assert log.rewind(3, reason="resumed") == 3
    log.log(4, {"reward/mean": 0.75})
    log.close()
    assert [(r["step"], r.get("reward/mean")) for r in lines(RunDir(tmp_path).metrics)][-3:] == [(2, 0.2), (3, 0.3), (4, 0.75)]


def test_tensorboard_reopens_with_purge_step_after_the_checkpoint(tmp_path, monkeypatch):
    """TensorBoard (not installed here: a recording stand-in) hides the killed run's events of
    the steps after the checkpoint when it is reopened with ``purge_step``."""
    made = []

    class Writer:
        def __init__(self, logdir, purge_step=None):
            made.append((Path(logdir).name, purge_step))

        def close(self):
            made.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    log = MetricsLogger(tmp_path, LoggingConfig(loggers=["tensorboard"]))
    log.rewind(3, reason="resumed")
    assert made == [("tensorboard", None), "closed", ("tensorboard", 4)]


def test_the_rollout_shards_after_the_checkpoint_step_move_aside_and_still_read(tmp_path):
    killed_run(tmp_path)
    store = RolloutStore(RunDir(tmp_path).rollouts)
    moved = store.set_aside_after(3, reason="resumed at step 3")
    assert [p.name for p in moved] == ["train-step000004-w000.parquet", "train-step000005-w000.parquet",
                                       "val-step000005-w000.parquet"]
    aside = moved[0].parent
    assert aside.parent == store.root / "superseded"
    record = json.loads((aside / "superseded.json").read_text())
    assert record["superseded_reason"] == "resumed at step 3" and record["after_step"] == 3
    assert record["shards"] == [p.name for p in moved]
    assert store.steps("train") == [1, 2, 3] and store.steps("val") == [3]
    assert [t.reward for t in RolloutStore(aside).iter_trajectories()] == [0.4, 0.5, 0.5]  # nothing lost
    assert store.set_aside_after(3, reason="again") == []


def test_a_resumed_run_sees_each_step_once_with_the_values_it_trained(tmp_path, capsys):
    """The resume path (``Trainer.set_aside_superseded``), then the resumed run logs and stores
    steps 4 and 5 again: the run directory's readers see one row and one shard a step, the
    resumed run's; without the set-aside, step 4 had two rows and the killed one came first
    (``agentrl replay report`` merges a step's trainer rows first come, first kept)."""
    killed_run(tmp_path)
    run = RunDir(tmp_path)
    log = MetricsLogger(tmp_path, LoggingConfig(loggers=["console"]))
    trainer = types.SimpleNamespace(log=log, run=run, start_step=3)
    Trainer.set_aside_superseded(trainer, run.checkpoint(3))
    store = RolloutStore(run.rollouts)
    for step in (4, 5):
        log.log(step, {"reward/mean": step / 100})
        store.write_step(step, [trajectory(step, step / 100)])
    log.close()
    by_step = [(r["step"], r["reward/mean"]) for r in run.read_metrics() if "reward/mean" in r]
    assert by_step == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.04), (5, 0.05)]
    assert [(s.split, s.step, s.trajectory.reward) for s in store.iter_stored()] == [
        ("train", 1, 0.1), ("train", 2, 0.2), ("train", 3, 0.3), ("train", 4, 0.04), ("train", 5, 0.05), ("val", 3, 0.5)]
    [aside] = (run.rollouts / "superseded").iterdir()
    assert capsys.readouterr().err.splitlines()[0] == (
        f"set aside what was logged after step 3: 3 rows of metrics.jsonl in metrics.superseded.jsonl and 3 rollout shards in {aside}")

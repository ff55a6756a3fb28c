"""The run directory: a new name never reuses a taken one, resume reopens, the config snapshot
loads back, a checkpoint appears whole or not at all and only the last few are kept."""

from __future__ import annotations

import json

import pytest

from agentrl.config import load_config
from agentrl.config.loader import validate_config
from agentrl.rundir import TRAINER_STATE, RunDir, make_run_dir


def test_a_taken_run_name_gets_a_suffix_and_resume_reopens_the_same_directory(tmp_path):
    cfg = load_config("train", [f"trainer.runs_root={tmp_path}", "trainer.run_name=exp"], check_files=False)
    first, second, third = make_run_dir(cfg), make_run_dir(cfg), make_run_dir(cfg)
    assert [r.path for r in (first, second, third)] == [tmp_path / "exp", tmp_path / "exp-1", tmp_path / "exp-2"]
    resumed = make_run_dir(load_config("train", [f"trainer.resume={second.path}"], check_files=False))
    assert resumed == second and sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp-1", "exp-2"]


def test_the_config_snapshot_loads_back_to_the_same_config(tmp_path):
    from omegaconf import OmegaConf

    cfg = load_config("train", ["algorithm.adv_estimator=rloo", "rollout.n=3", "agent.max_assistant_turns=7"], check_files=False)
    run = RunDir(tmp_path)
    run.write_config(cfg)
    again = validate_config(OmegaConf.to_container(OmegaConf.load(run.config), resolve=True), check_files=False)
    assert again == cfg


def test_a_checkpoint_appears_whole_and_only_the_last_ones_are_kept(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3):
        with run.new_checkpoint(step, keep=2) as directory:
            assert directory.name == f"step_{step}.tmp" and not run.checkpoint(step).exists()
            (directory / TRAINER_STATE).write_text(json.dumps({"step": step}))
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_2", "step_3"]
    assert run.latest_checkpoint() == run.checkpoint(3)

    with pytest.raises(RuntimeError), run.new_checkpoint(10, keep=2) as directory:  # killed mid-write
        (directory / TRAINER_STATE).write_text("{}")
        raise RuntimeError("worker died")
    assert (run.checkpoints / "step_10.tmp").is_dir() and not run.checkpoint(10).exists()
    assert run.latest_checkpoint() == run.checkpoint(3)  # the interrupted one is never resumed from
    (run.checkpoint(3) / TRAINER_STATE).unlink()  # a step_N without trainer state is incomplete too
    assert run.latest_checkpoint() == run.checkpoint(2)


def test_the_summary_and_the_metrics_round_trip(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_metrics() == []
    run.metrics.write_text('{"step": 1, "reward/mean": 0.5}\n\n{"step": 2, "reward/mean": 0.75}\n')
    assert run.read_metrics() == [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    run.write_summary({"steps": 2})
    assert json.loads(run.summary.read_text()) == {"steps": 2}
    page = run.write_report([], {"steps": 2}).read_text()
    assert "<svg" in page and f"agentrl run {tmp_path.name}" in page


def test_resume_auto_finds_the_run_with_the_newest_complete_checkpoint_or_starts_a_new_one(tmp_path):
    import os

    from agentrl.rundir import auto_resume

    def checkpoint(run: str, step: int, *, complete: bool = True, mtime: float = 0.0) -> None:
        directory = tmp_path / run / "checkpoints" / (f"step_{step}" if complete else f"step_{step}.tmp")
        directory.mkdir(parents=True)
        if complete:
            (directory / TRAINER_STATE).write_text(json.dumps({"step": step}))
            os.utime(directory / TRAINER_STATE, (mtime, mtime))

    checkpoint("a", 1, mtime=1_000)
    checkpoint("b", 2, mtime=2_000)  # the newest complete checkpoint
    checkpoint("c", 3, complete=False)  # killed while writing its only checkpoint: nothing to resume
    (tmp_path / "empty").mkdir()
    assert auto_resume(tmp_path, None) == tmp_path / "b"
    assert auto_resume(tmp_path, "a") == tmp_path / "a"
    assert auto_resume(tmp_path, "c") is None and auto_resume(tmp_path / "missing", None) is None
    cfg = load_config("train", ["trainer.resume=auto", f"trainer.runs_root={tmp_path}", "trainer.run_name=a"])
    assert make_run_dir(cfg).path == tmp_path / "a" and cfg.trainer.resume == str(tmp_path / "a")
    cfg = load_config("train", ["trainer.resume=auto", f"trainer.runs_root={tmp_path}", "trainer.run_name=c"])
    assert make_run_dir(cfg).path == tmp_path / "c-1" and cfg.trainer.resume is None  # a new run, named as asked

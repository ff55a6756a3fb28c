"""DAPO's pieces wired into a real run through Ray: dynamic sampling draws more rows until
groups with a reward spread fill the batch (or gives up after ``max_num_gen_batches``), the
overlong filter and penalty reach the step, and every draw is stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_train_run import metrics_by_step, run_cli

pytestmark = pytest.mark.ray

DAPO_SHORT = [
    "algorithm=dapo", "trainer=default", "sft.enable=false", "trainer.total_steps=2", "trainer.save_freq=0",
    "trainer.test_freq=0", "trainer.val_before_train=false", "data.train_batch_size=2", "rollout.n=2",
    "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "data.task_train_size=32",
    "rollout.max_new_tokens=16", "data.max_response_length=48", "algorithm.overlong_buffer.len=16",
    "algorithm.filter_groups.max_num_gen_batches=2", "algorithm.overlong_filter=true", "logging.progress=false",
    "trainer.threads_per_worker=1",
]


def test_dapo_run_draws_again_when_groups_are_uniform_and_stores_every_draw(tmp_path):
    done = run_cli(DAPO_SHORT + [f"trainer.runs_root={tmp_path}", "trainer.run_name=dapo"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "dapo"
    steps = metrics_by_step(run)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        drawn, dropped, kept = m["dynamic_sampling/groups_drawn"], m["dynamic_sampling/groups_dropped"], m["dynamic_sampling/groups_kept"]
        assert kept <= 2 and drawn - dropped >= kept
        assert 1 <= m["dynamic_sampling/gen_batches"] <= 2
        if m["dynamic_sampling/gen_batches"] == 1:  # it stopped drawing only with a full batch of spread groups
            assert drawn - dropped >= 2 and kept == 2
        assert m["dynamic_sampling/groups_drawn"] == 2 * m["dynamic_sampling/gen_batches"]
        assert 0.0 <= m["overlong/penalized_fraction"] <= 1.0 and 0.0 <= m["overlong/filtered_fraction"] <= 1.0
    import pyarrow.parquet as pq

    stored = pq.read_table(run / "rollouts").to_pydict()
    for step, m in steps.items():
        n = sum(1 for s, split in zip(stored["step"], stored["split"]) if s == step and split == "train")
        assert n == 2 * 2 * m["dynamic_sampling/gen_batches"]  # every draw's trajectories, kept or not
        marks = [d for s, split, d in zip(stored["step"], stored["split"], stored["dropped"]) if s == step and split == "train"]
        assert set(marks) <= {None, "filtered"}  # the groups not trained are marked, the trained ones not
        trained = marks.count(None)
        assert trained == 2 * m["dynamic_sampling/groups_kept"] or (m["dynamic_sampling/groups_kept"] == 0 and trained == 2 * 2)
    config = (run / "config.yaml").read_text()
    assert "clip_ratio_high: 0.28" in config and "loss_agg_mode: token-mean" in config

"""`agentrl rollout` stores exact trajectories; the rollout file format round-trips."""

from __future__ import annotations

import subprocess
import sys

from agent_helpers import CALL_12x34, make_row

from agentrl.trajectory_io import SCHEMA_VERSION, read_trajectories, write_trajectories


def test_trajectories_round_trip_exactly(run_rows, tmp_path):
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    trajectories, *_ = run_rows({"r0": [CALL_12x34, "#### 400", "#### 408"]}, [("r0", row)], n=2)
    path = write_trajectories(trajectories, tmp_path / "t.parquet", step=3)
    assert list(read_trajectories(path)) == trajectories
    import pyarrow.parquet as pq

    assert pq.ParquetFile(path).schema_arrow.metadata[b"agentrl_schema_version"] == SCHEMA_VERSION.encode()


def test_rollout_command_writes_the_rollouts(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "data.task_train_size=6", "rollout.n=2", "rollout.max_new_tokens=8",
         f"trainer.runs_root={tmp_path}", "trainer.run_name=r", "logging.progress=false"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"rollouts: {tmp_path / 'r' / 'rollouts' / 'rollout-00000.parquet'}"
    trajectories = list(read_trajectories(last.removeprefix("rollouts: ")))
    assert len(trajectories) == 12 and {t.sample_index for t in trajectories} == {0, 1}
    assert all(len(t.response_ids) == len(t.response_mask) == len(t.logprobs) > 0 for t in trajectories)

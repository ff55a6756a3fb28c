"""``agentrl train`` on an agent program it does not know: the plain-``openai`` GSM8K-style
calculator agent (``agent_programs/gsm8k_calculator.py``) behind the ``openai_agent`` loop."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.data.rollout_store import RolloutStore


@pytest.mark.ray
def test_two_grpo_steps_of_a_plain_openai_agent(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    rows = []
    for i in range(4):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({
            "data_source": "agentrl/arith", "agent_name": "openai_agent",
            "prompt": [{"role": "system", "content": "Use the calculator. End with '#### N'."},
                       {"role": "user", "content": f"What is {a} + {b}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i, "agent_program": "gsm8k_calculator"},
        })
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", f"data.train_files=[{tmp_path / 'rows.parquet'}]",
        "data.task=null", f"model.path={tiny_model_dir}", "sft.enable=false", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "data.train_batch_size=4", "rollout.n=2",
        "rollout.max_new_tokens=16", "data.max_response_length=96", "actor.ppo_mini_batch_size=4",
        f"trainer.runs_root={tmp_path}", "trainer.run_name=byo", "logging.progress=false", "trainer.threads_per_worker=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "byo" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["trajectories/loop_errors"] == 0 and s["tokens/sampled"] > 0
        assert 0.0 <= s["reward/mean"] <= 1.0 and "success_rate" in s
        assert s["logprob_mismatch/max"] < 1e-4  # the trainer's logprobs of the stored tokens equal the engine's
    stored = list(RolloutStore(tmp_path / "byo" / "rollouts").iter_stored())
    assert len(stored) == 2 * 4 * 2
    for s in stored:
        t = s.trajectory
        assert t.agent_name == "openai_agent" and "segment_splits" in t.metrics
        assert s.row.prompt[-1].content.split("What is ")[1].rstrip("?") in t.messages[1]["content"]  # its own row

"""``agentrl train`` with ``agent.history=as_template`` on a template that rewrites its history:
the released Qwen3 template with thinking off (``model.chat_template``), whose history drops the
empty ``<think></think>`` block of every earlier generation prompt. Every request after a tool
result or a retry starts a new segment; the segments train, and the engine's logprobs of their
sampled tokens agree with the trainer's at fp32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "tests" / "fixtures" / "families" / "qwen3" / "chat_template.jinja"


def test_as_template_trains_segmented_trajectories_with_engine_and_trainer_logprobs_in_agreement(tmp_path):
    args = [
        "data=arith_retry", "sft.enable=false", "trainer.total_steps=1", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.max_new_tokens=32",
        "data.max_response_length=256", "data.task_train_size=8", "data.task_val_size=4", "trainer.test_freq=0",
        "trainer.final_validation=false", "logging.progress=false", "rollout.temperature=1.0",
        f"model.chat_template={QWEN3}", "agent.chat_template_kwargs={enable_thinking:false}", "agent.history=as_template",
        f"trainer.runs_root={tmp_path}", "trainer.run_name=history",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "history" / "metrics.jsonl").read_text().splitlines()]
    [step] = [row for row in rows if "reward/mean" in row]  # the training step (validation rows hold val/ keys)
    assert step["trajectories/earlier_segments"] > 0  # segments were trained, as rows sharing the trajectory's advantage
    # a trajectory's segments share its tokens up to the rewritten turn: the packed forward computes them once
    assert step["tokens/sampled"] < step["perf/tokens_computed"] < step["perf/tokens_rows"]
    assert step["logprob_mismatch/mean"] < 1e-6 and step["logprob_mismatch/max"] < 1e-4
    # the run's policy renders with the template it was given (model.chat_template reaches every tokenizer)
    assert (tmp_path / "history" / "policy" / "chat_template.jinja").read_text() == QWEN3.read_text()

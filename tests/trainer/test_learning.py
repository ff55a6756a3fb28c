"""Short real PPO and GRPO runs through Ray on CPU raise the reward.

The task: answer with the digit 7 (``gsm8k_flexible`` scores the last number). A short SFT warm
start on demonstrations that answer 7 only half of the time (the other half a random digit)
leaves the policy right about half of the time, so both algorithms have a signal from the first
step and the test stays short. The quickstart shows the tool task.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.data.io import write_rows

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def digit_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "test/seven",
            "prompt": [{"role": "user", "content": f"Say seven. ({i})"}],
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"index": i},
            "agent_name": "single_turn",
        }
        for i in range(n)
    ]


def demos(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"Say seven. ({i})"}, {"role": "assistant", "content": "7" if i % 2 else str(i % 7)}]}
        for i in range(n)
    ]


# PPO's one on-policy mini-batch is not clipped (ratio 1): at 6e-4 a step-6 update (grad norm 6.7)
# made the policy stop ending its answers and the reward fell from 0.75 to 0.06 (seed 0; seeds 1 and
# 2 rose). At 3e-4 the reward rose on seeds 0, 1, 2 by 0.21, 0.41 and 0.32 over 12 steps.
LR = {"grpo": "6e-4", "ppo": "3e-4"}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_reward_rises(algorithm, tmp_path):
    train = write_rows(digit_rows(64), tmp_path / "train.parquet")
    sft = write_rows(demos(128), tmp_path / "sft.parquet")
    args = [
        f"algorithm={algorithm}", "data.task=null", f"data.train_files=[{train}]", f"sft.train_files=[{sft}]",
        "sft.epochs=2", "sft.optim.lr=3e-3", "sft.batch_size=16", "sft.micro_batch_size=16", "sft.stop_at_success=null",
        "sft.optim.lr_warmup_steps=0", "sft.optim.lr_scheduler=constant", "sft.optim.betas=[0.9,0.999]",
        # this test's own RL settings, not the quickstart's
        "rollout.temperature=1.0", "actor.use_kl_loss=false", "actor.optim.lr_warmup_steps=0",
        "agent.default_loop=single_turn", "reward.default=gsm8k_flexible", "trainer.total_steps=12", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.export_hf=false", "data.train_batch_size=8",
        "rollout.n=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=64", "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size_per_gpu=64", "rollout.max_new_tokens=6", "data.max_response_length=8",
        f"actor.optim.lr={LR[algorithm]}", "critic.optim.lr=1e-3", "logging.progress=false", f"trainer.runs_root={tmp_path}",
        "trainer.run_name=run",
    ]
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    steps = [r for r in rows if "reward/mean" in r]
    # one mini-batch of one epoch: the update's own forward gave the old logprobs (no separate
    # pass), and they agree with the engine's as a separate pass would
    assert all("timing/old_logprobs_s" not in r for r in steps)
    assert all(r["logprob_mismatch/mean"] < 1e-3 for r in steps)
    if algorithm == "ppo":
        assert all("critic/vf_loss" in r for r in rows if "reward/mean" in r)


def test_rl_raises_the_tool_use_of_a_policy_that_seldom_calls_its_tool(tmp_path):
    """The quickstart's setting, shortened: from the calculator-skilled base, the warm start on a
    demonstrator who answers 85% of the questions mentally (and wrongly) leaves a policy that calls
    the calculator on about 15% of its samples; GRPO raises that from the reward alone. Measured
    (2026-11-26, seed 0): tool-use rate 0.125, 0.156, 0.125 at steps 1-3 and 0.77, 0.77, 0.94 at
    steps 10-12; the run takes about 40 s."""
    args = ["trainer.total_steps=12", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false",
            "trainer.export_hf=false", "logging.progress=false", f"trainer.runs_root={tmp_path}", "trainer.run_name=run"]
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tool_use_rate" in r and "reward/mean" in r]
    assert len(steps) == 12
    use = [r["tool_use_rate"] for r in steps]
    first, last = sum(use[:3]) / 3, sum(use[-3:]) / 3
    assert first <= 0.3, use  # the warm start seldom calls the tool
    assert last >= first + 0.3, use
    # where the tool is used the answer is right: the success follows the tool use up
    success = [r["success_rate"] for r in steps]
    assert sum(success[-3:]) / 3 >= sum(success[:3]) / 3 + 0.2, success

"""``agentrl train`` on an OpenEnv environment it does not know (``openenv_fixture:ReplyEnvironment``,
served by OpenEnv's own server code in a process agentrl starts): three GRPO steps on the tiny
model, rows naming the environment and no loop. The server is killed mid-run (the environment kills
its own process at the step after a marker file appears): that trajectory fails
``environment_error``, out of the loss and counted, and the next trajectory restarts the server.
Every other trajectory is token-exact (the trainer scores the sampled tokens as the engine did),
its turn rewards are the environment's step rewards for the replies it holds, and the step's
advantages are GRPO's over those rewards, computed here by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.data.rollout_store import RolloutStore

HERE = Path(__file__).resolve().parent
LETTERS = ["a", "e", "o", "i"]


def grpo(scores: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    """GRPO advantages as agentrl defines them (unbiased std; a lone sample keeps its score)."""
    out = []
    for s, g in zip(scores, groups):
        mine = [x for x, h in zip(scores, groups) if h == g]
        if len(mine) < 2:
            out.append(s)
            continue
        mean = sum(mine) / len(mine)
        std = (sum((x - mean) ** 2 for x in mine) / (len(mine) - 1)) ** 0.5
        out.append((s - mean) / (std + eps))
    return out


@pytest.mark.ray
def test_three_grpo_steps_on_an_openenv_environment_with_its_server_killed_mid_run(tmp_path):
    marker = tmp_path / "kill-once"
    marker.write_text("")
    rows = []
    for i, letter in enumerate(LETTERS):
        args = {"letter": letter, "kill_marker": str(marker) if i == 0 else None}
        rows.append({"data_source": "openenv/reply", "prompt": [{"role": "user", "content": "Play."}],
                     "extra_info": {"index": i, "environment": {"library": "openenv",
                                                                "name": "openenv_fixture:ReplyEnvironment", "args": args}}})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", f"data.train_files=[{tmp_path / 'rows.parquet'}]",
        "data.task=null", "model.tiny.skills=none", "sft.enable=false", "trainer.total_steps=3", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false", "data.train_batch_size=4",
        "rollout.n=2", "rollout.max_new_tokens=12", "data.max_response_length=96", "actor.ppo_mini_batch_size=4",
        "environment.openenv.max_sessions=1", f"trainer.runs_root={tmp_path}", "trainer.run_name=oe",
        "logging.progress=false", "trainer.threads_per_worker=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()  # the environment killed its server once
    steps = [json.loads(line) for line in (tmp_path / "oe" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # step 1: the killed server's trajectory failed, left out of the loss, counted by kind; the
    # next trajectory restarted the server; steps 2 and 3 ran clean
    assert steps[0]["failures/environment_error"] == 1 and steps[0]["trajectories/loop_errors"] == 1
    assert steps[0]["env_errors/server_lost"] == 1 and steps[0]["env_errors/server_restarts"] == 1
    for s in steps[1:]:
        assert s["failures/rate"] == 0.0 and s["trajectories/loop_errors"] == 0 and "env_errors/server_restarts" not in s
    for s in steps:  # the trainer's logprobs of the sampled tokens are the engine's (measured: mean 2e-7, max 1e-6)
        assert s["logprob_mismatch/mean"] < 1e-5 and s["logprob_mismatch/max"] < 1e-5, s
    stored = list(RolloutStore(tmp_path / "oe" / "rollouts").iter_stored())
    assert len(stored) == 3 * 4 * 2
    failed = [s.trajectory for s in stored if s.trajectory.finish_reason == "environment_error"]
    assert len(failed) == 1 and "lost the OpenEnv server" in failed[0].reward_info["error"]
    assert failed[0].row_id == "openenv/reply:0" and failed[0].metrics["env_errors/server_lost"] == 1
    for metrics, step in zip(steps, sorted({s.step for s in stored})):
        usable = [s for s in stored if s.step == step and s.trajectory.finish_reason != "environment_error"]
        scores, groups, sampled = [], [], []
        for s in usable:
            t, letter = s.trajectory, s.row.extra_info.environment.args["letter"]
            assert t.agent_name == "openenv_env" and t.reward == 0.0
            replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
            rewards = [x.reward or 0.0 for x in t.turns if x.role == "assistant"]
            # each assistant turn carries the step reward of its reply (cut at max_new_tokens or not), a
            # quarter per letter, at most 1.0; two steps, then done
            assert rewards == [min(r.count(letter), 4) / 4 for r in replies], (replies, rewards)
            assert t.finish_reason == "stop" and len(replies) == 2 and t.metrics["env/done"] == 1
            assert t.metrics["env/return"] == sum(rewards)
            scores.append(sum(rewards) + t.reward)
            groups.append(t.group_id)
            sampled.append(sum(t.response_mask))
        advantages = grpo(scores, groups)
        # the rewards reached the advantages: GRPO's over the step rewards, token-weighted mean and max
        assert abs(metrics["advantages/abs_max"] - max(abs(a) for a, n in zip(advantages, sampled) if n)) < 1e-5
        mean = sum(a * n for a, n in zip(advantages, sampled)) / sum(sampled)
        assert abs(metrics["advantages/mean"] - mean) < 1e-5
        assert metrics["tokens/sampled"] == sum(sampled)
    assert any(score > 0 for s in stored for score in [sum(x.reward or 0.0 for x in s.trajectory.turns)])

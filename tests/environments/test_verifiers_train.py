"""``agentrl train`` on a verifiers environment named in the config alone (no data files): its
dataset trains, its eval dataset validates, its own rollout code runs against the endpoint, the
tokens are the engine's, the rubric's reward reaches the GRPO advantage, and the rows whose
environment fails are counted and left out of the loss."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

import pytest

from agentrl.data.rollout_store import RolloutStore
from agentrl.trainer.step import INFRA_FAILURES

pytest.importorskip("verifiers")
from test_verifiers import ENVS  # noqa: E402  (the environments a verifiers user wrote, as a module of their own)


def grpo_advantages(scores: list[float]) -> list[float]:
    """GRPO by hand: each score minus its group's mean over the group's unbiased std + 1e-6; a
    member alone in its group has no baseline (its score over 1 + 1e-6)."""
    if len(scores) < 2:
        return [s / (1 + 1e-6) for s in scores]
    mean, std = statistics.fmean(scores), statistics.stdev(scores)
    return [(s - mean) / (std + 1e-6) for s in scores]


def test_two_grpo_steps_on_a_verifiers_environment_named_in_the_config(tmp_path, tiny_model_dir):
    (tmp_path / "vf_test_envs.py").write_text(textwrap.dedent(ENVS))
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([
        sys.executable, "-m", "agentrl.cli", "train", "environment.library=verifiers", "environment.name=vf_test_envs:load_guess",
        # four rows, the last one's environment fails in its setup (its samples: environment_error)
        "environment.args={rows: 4, explode: 3, max_turns: 3}", f"model.path={tiny_model_dir}", "sft.enable=false",
        "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=true", "trainer.save_freq=0",
        "trainer.export_hf=false", "data.train_batch_size=2", "data.shuffle=false", "rollout.n=3", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=3", "rollout.max_new_tokens=8", "data.max_response_length=96",
        "trainer.max_failure_rate=0.9", f"trainer.runs_root={tmp_path}", "trainer.run_name=vf", "logging.progress=false",
        "trainer.threads_per_worker=1"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "vf" / "data" / "val.parquet").exists()  # the eval dataset validates
    lines = [json.loads(line) for line in (tmp_path / "vf" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/reward/mean" in m for m in lines)
    steps = {m["step"]: m for m in lines if "reward/mean" in m}
    assert sorted(steps) == [1, 2]
    stored = [s for s in RolloutStore(tmp_path / "vf" / "rollouts").iter_stored() if s.split == "train"]
    assert len(stored) == 2 * 2 * 3
    for step, metrics in steps.items():
        trajectories = [s.trajectory for s in stored if s.step == step]
        assert {t.agent_name for t in trajectories} == {"verifiers_env"}
        usable = [t for t in trajectories if t.finish_reason not in INFRA_FAILURES and t.response_ids]
        # the trainer scores the stored tokens as the engine sampled them
        assert metrics["logprob_mismatch/mean"] < 1e-5 and metrics["logprob_mismatch/max"] < 1e-4
        assert metrics["tokens/sampled"] == sum(sum(t.response_mask) for t in usable) > 0
        # the rubric's functions, logged; its weighted sum (plus the step rewards, agentrl's turn
        # rewards) is the GRPO score: the advantage, by hand from the stored rewards
        assert {"env/solved", "env/fewest_guesses", "env/length", "env/num_turns"} <= set(metrics)
        for t in usable:
            parts = t.reward_info
            assert t.reward == pytest.approx(parts["env/solved"] + 0.5 * parts["env/fewest_guesses"] + 0.25 * parts["env/length"])
        advantages, tokens = [], []
        for group in sorted({t.group_id for t in usable}):
            members = [t for t in usable if t.group_id == group]
            scores = [t.reward + sum(x.reward or 0.0 for x in t.turns if x.role == "assistant") for t in members]
            advantages += grpo_advantages(scores)
            tokens += [sum(t.response_mask) for t in members]
        # (the trainer's fp32: scores near 1 that differ by about 1e-3 keep 4-5 digits of their difference)
        assert metrics["advantages/abs_max"] == pytest.approx(max(abs(a) for a in advantages), abs=1e-4)
        assert metrics["advantages/mean"] == pytest.approx(sum(a * n for a, n in zip(advantages, tokens)) / sum(tokens), abs=1e-4)
        assert metrics["advantages/abs_max"] > 0.1  # the length reward differs within a group: a signal
    # the failing row's three samples: counted, kept in the store with the error, out of the loss
    failed = [s.trajectory for s in stored if s.trajectory.finish_reason == "environment_error"]
    assert len(failed) == 3 and all(t.reward_info["error"] == "RuntimeError: the guessing backend is gone" for t in failed)
    assert steps[2]["failures/environment_error"] == 3 and steps[2]["env_errors/exception"] == 3
    assert steps[2]["trajectories/loop_errors"] == 3 and "failures/environment_error" not in steps[1]

"""`agentrl bench trainer --json` runs end to end and prints one JSON object (a smoke check of
the command, with tiny settings; the figures themselves are in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HAVE_TRL = importlib.util.find_spec("trl") is not None


def test_bench_trainer_prints_one_json_object_with_both_sides():
    args = ["--steps", "2", "--prompts", "2", "--n", "4", "--max-new-tokens", "4", "--eval-prompts", "4", "--eval-samples", "2"]
    if not HAVE_TRL:
        args.append("--skip-trl")
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "bench", "trainer", "--json", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]  # TRL's own logs go to stderr
    out = json.loads(lines[0])
    assert out["settings"]["steps"] == 2 and out["settings"]["n"] == 4
    assert len(out["agentrl_train_rewards"]) == 2
    assert out["agentrl_step_s"] > 0 and 0.0 <= out["agentrl_reward"] <= 1.0
    if HAVE_TRL:
        assert len(out["trl_train_rewards"]) == 2 and 0.0 <= out["trl_reward"] <= 1.0
        assert out["ratio"] == pytest.approx(out["trl_step_s"] / out["agentrl_step_s"], rel=1e-2)  # the figures are rounded to 4 decimals


def test_agentrl_side_has_the_matched_settings_not_the_quickstart_preset(tmp_path, tiny_model_dir):
    from agentrl.data.io import write_rows
    from agentrl_benchmarks.trainer import Settings, _rows, agentrl_config

    train_file = write_rows(_rows(0, 8), tmp_path / "train.parquet")
    cfg = agentrl_config(tiny_model_dir, train_file, tmp_path, Settings())
    assert not cfg.use_reference and not cfg.actor.use_kl_loss  # TRL's beta=0: no KL, no reference model
    assert cfg.actor.optim.lr_warmup_steps == 0 and cfg.actor.optim.lr_scheduler == "constant"
    assert cfg.actor.optim.lr == Settings().lr and cfg.actor.optim.betas == (0.9, 0.999)
    assert cfg.rollout.temperature == Settings().temperature and cfg.rollout.n == Settings().n
    assert not cfg.trainer.save_rollouts  # TRL keeps no rollouts: the same work on both sides


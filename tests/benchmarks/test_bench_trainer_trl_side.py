"""TRL's side of `agentrl bench trainer`: one config for the race and for its one-batch probe
(``agentrl_benchmarks.race_batch``), and the TRL-only runs of ``--skip-agentrl`` (TRL's spread
over its own seed). Fast: no training."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from agentrl_benchmarks import trainer as bench


def test_the_one_batch_probe_builds_trl_with_the_races_config_in_fp32(tiny_model_dir, tmp_path):
    """race_batch once built its own GRPOConfig and left ``bf16`` at TRL's default (on), so its
    TRL gradient came from a bf16-autocast forward (off the exact one) while the race ran fp32;
    both now take ``trl_config``."""
    pytest.importorskip("trl")
    from agentrl_benchmarks import race_batch

    settings = bench.Settings(task="calculator", prompts=2, n=4, steps=1, max_new_tokens=96, lr=1e-4)
    trainer, rows = race_batch._trl_trainer(tiny_model_dir, tmp_path, settings, prompts=2, trl_bf16=False)
    race = bench.trl_config(settings, tmp_path / "race", max_tool_calling_iterations=3)
    assert trainer.args.bf16 is False and trainer.args.fp16 is False and race.bf16 is False
    for key in ("per_device_train_batch_size", "num_generations", "max_completion_length", "learning_rate", "epsilon", "beta",
                "loss_type", "scale_rewards", "num_iterations", "temperature", "top_p", "top_k", "max_grad_norm", "weight_decay",
                "lr_scheduler_type", "seed", "gradient_checkpointing", "max_tool_calling_iterations"):
        assert getattr(trainer.args, key) == getattr(race, key), key
    assert len(rows) == 2


def test_skip_agentrl_runs_trl_alone_without_ratios(tmp_path, monkeypatch):
    ran: list[str] = []

    def fake_process(side, start, work, settings):
        ran.append(side)
        return {"step_times": [2.0, 1.0], "tokens": [8.0, 8.0], "train_rewards": [0.1, 0.2], "wall_s": 3.0, "e2e_s": 4.0,
                "policy": Path(side)}

    monkeypatch.setattr(bench, "warm_start", lambda model_dir, out, settings: out)
    monkeypatch.setattr(bench, "_run_side_process", fake_process)
    monkeypatch.setattr(bench, "evaluate", lambda path, settings, work: 0.5 if path.name == "start" else 0.75)
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="9.9"))
    monkeypatch.setattr("agentrl.tiny.tiny_model_dir", lambda size, seed: tmp_path / "tiny")
    out = bench._run_both(bench.Settings(steps=2, repeats=2), tmp_path, with_trl=True, with_agentrl=False)
    assert ran == ["trl", "trl"] and out["order"] == ["trl", "trl"]
    assert out["trl_reward_all"] == [0.75, 0.75] and out["trl_version"] == "9.9"
    assert not any(key.startswith("agentrl_") for key in out) and "ratio" not in out and "e2e_ratio" not in out


def test_skipping_both_sides_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--skip-trl", "--skip-agentrl"])


def test_the_calculator_race_scores_the_held_out_answers_it_reports_with_their_standard_error(tmp_path, monkeypatch):
    """The calculator's evaluation is ``--eval-prompts`` questions x ``--eval-samples`` samples
    (its defaults 64 x 4), the count ``eval_answers`` reports; each held-out figure comes with its
    binomial standard error over those answers."""
    import json

    import agentrl.agent.rollout_cli as rollout_cli
    from agentrl.data.io import count_rows
    from agentrl_benchmarks import trainer_calculator as calculator

    seen: dict[str, object] = {}

    def fake_rollout(argv):
        args = dict(a.split("=", 1) for a in argv)
        seen["n"], seen["rows"] = args["rollout.n"], count_rows(args["data.train_files"].strip("[]"))
        run = Path(args["trainer.runs_root"]) / args["trainer.run_name"]
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"reward_mean": 0.75}))
        return 0

    monkeypatch.setattr(rollout_cli, "cli_main", fake_rollout)
    settings = bench.Settings(**{"task": "calculator", **bench.TASK_DEFAULTS["calculator"]})
    assert (settings.eval_prompts, settings.eval_samples) == (64, 4)
    assert calculator.evaluate(tmp_path / "policy", tmp_path / "eval", settings) == 0.75
    assert seen == {"n": "4", "rows": 64}

    monkeypatch.setattr(calculator, "warm_start", lambda out, settings: out)
    monkeypatch.setattr(bench, "_run_side_process", lambda side, start, work, settings: {
        "step_times": [2.0, 1.0], "tokens": [8.0, 8.0], "train_rewards": [0.1, 0.2], "wall_s": 3.0, "e2e_s": 4.0, "policy": Path(side)})
    monkeypatch.setattr(bench, "evaluate", lambda path, settings, work: 0.5 if path.name == "start" else 0.75)
    out = bench._run_both(bench.Settings(**{**settings.__dict__, "repeats": 1}), tmp_path / "race", with_trl=False)
    assert out["eval_answers"] == 256
    assert out["start_reward_se"] == pytest.approx((0.25 / 256) ** 0.5)
    assert out["agentrl_reward_se"] == pytest.approx((0.75 * 0.25 / 256) ** 0.5)

"""agentrl bench async: its overrides are a valid configuration and its figures are computed right."""

from __future__ import annotations

import argparse

import pytest

from agentrl_benchmarks.async_training import overrides, summarize, summarize_run


def _args(**changes) -> argparse.Namespace:
    base = dict(steps=2, batch_size=2, n=4, max_new_tokens=32, max_response_length=256, max_turns=8, sft=False,
                latency_median_s=0.3, latency_p99_s=6.2)
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.parametrize("eta,partial", [(0, False), (2, True)])
def test_every_configuration_is_a_valid_train_config_with_the_latency_on_the_calculator(eta, partial):
    from agentrl.config import load_config

    cfg = load_config("train", overrides(eta=eta, partial=partial, seed=3, args=_args()), check_files=False)
    assert cfg.agent.tool_config["calculator"] == {"latency_median_s": 0.3, "latency_p99_s": 6.2, "latency_seed": 3}
    assert (cfg.rollout.max_staleness, cfg.rollout.partial, cfg.trainer.seed) == (eta, partial, 3)
    assert cfg.actor.rollout_correction.level == ("token" if eta else None)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.agent.max_assistant_turns) == (2, 4, 8)


def test_a_runs_figures_come_from_its_steps():
    rows = [
        {"timing/step_s": 2.0, "tokens/per_s": 50.0, "reward/mean": 0.25, "async/trainer_idle_fraction": 0.5,
         "engine/busy_fraction": 0.75, "async/staleness_hist/0": 8.0, "engine/interrupted_requests": 1.0},
        {"timing/step_s": 6.0, "tokens/per_s": 10.0, "reward/mean": 0.75, "async/trainer_idle_fraction": 0.0,
         "engine/busy_fraction": 0.25, "async/staleness_hist/0": 2.0, "async/staleness_hist/1": 6.0},
    ]
    run = summarize_run(rows, eta=1, samples_per_step=8)
    assert run["trajectories_per_s"] == 16 / 8 and run["tokens_per_s"] == (100 + 60) / 8
    assert (run["trainer_idle_fraction"], run["engine_busy_fraction"]) == (0.25, 0.5)
    assert run["staleness_hist"] == {0: 10.0, 1: 6.0} and run["interrupted_requests"] == 1.0
    assert run["reward_per_sample"] == 0.5
    assert run["curve"] == [{"step": 1, "samples": 8, "wall_s": 2.0, "reward": 0.25},
                            {"step": 2, "samples": 16, "wall_s": 8.0, "reward": 0.75}]
    sync = summarize_run([{"timing/step_s": 4.0, "timing/rollout_s": 3.0, "tokens/per_s": 5.0, "reward/mean": 1.0}],
                         eta=0, samples_per_step=8)
    assert sync["trainer_idle_fraction"] == 0.75 and sync["engine_busy_fraction"] is None
    summary = summarize([{"config": "sync", **sync}, {"config": "eta1", **run}, {"config": "eta1", **dict(run, reward_per_sample=1.0)}])
    assert summary["eta1"]["speedup"] == 2.0 / 2.0 and summary["sync"]["speedup"] == 1.0
    assert summary["eta1"]["reward_per_sample"] == 0.75 and summary["eta1"]["reward_std"] == pytest.approx(0.3535533905932738)

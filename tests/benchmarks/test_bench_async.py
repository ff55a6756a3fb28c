"""agentrl bench async: its overrides are a valid configuration and its figures are computed right."""

from __future__ import annotations

import argparse

import pytest

from agentrl_benchmarks.async_training import (
    last_complete_version, overrides, reward_by_version, run_order, summarize, summarize_run,
)


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
    assert cfg.trainer.save_rollouts  # the samples' versions and rewards: reward_by_version
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
    summary = summarize([{"config": "sync", "eta": 0, **sync}, {"config": "eta1", "eta": 1, **run},
                         {"config": "eta1", "eta": 1, **dict(run, reward_per_sample=1.0)}])
    assert summary["eta1"]["speedup"] == 2.0 / 2.0 and summary["sync"]["speedup"] == 1.0
    assert summary["eta1"]["reward_per_sample"] == 0.75 and summary["eta1"]["reward_std"] == pytest.approx(0.3535533905932738)


def test_the_summary_holds_each_eta_to_its_floor_and_the_reward_to_one_sync_sd():
    def run(config, eta, per_s, reward):
        return {"config": config, "eta": eta, "trajectories_per_s": per_s, "tokens_per_s": 1.0, "reward_per_sample": reward}

    sync = [dict(run("sync", 0, 2.0, 0.5), heldout_success_after=0.5), dict(run("sync", 0, 2.0, 0.7), heldout_success_after=1.0)]
    # reward mean 0.6, sd 0.1414
    summary = summarize(sync + [run("eta1", 1, 3.0, 0.6), run("eta1", 1, 3.0, 0.6),  # 1.5x: just at its floor
                                run("eta2", 2, 2.9, 0.6), run("eta4", 4, 5.0, 0.45), run("eta4", 4, 5.0, 0.45),
                                run("eta3", 3, 3.0, 0.6)])
    assert "floor" not in summary["sync"] and summary["sync"]["heldout_success_after"] == 0.75
    assert summary["eta1"]["heldout_success_after"] is None  # runs without a final validation
    assert (summary["eta1"]["floor"], summary["eta2"]["floor"], summary["eta3"]["floor"], summary["eta4"]["floor"]) == \
        (1.5, 1.5, 1.5, 2.5)
    assert summary["eta1"]["meets_floors"] and summary["eta3"]["meets_floors"]
    assert not summary["eta2"]["meets_floors"] and summary["eta2"]["reward_within_sync_sd"]  # 1.45x
    assert summary["eta4"]["speedup"] == 2.5 and not summary["eta4"]["reward_within_sync_sd"]  # 0.15 below: over one sd
    assert not summary["eta4"]["meets_floors"]
    assert "heldout_within_sync_sd" not in summary["eta1"]  # no validation to compare


def test_held_out_success_is_compared_to_one_sync_sd_below_the_sync_mean():
    def run(config, eta, heldout):
        return {"config": config, "eta": eta, "trajectories_per_s": 1.0, "tokens_per_s": 1.0, "reward_per_sample": 0.5,
                "heldout_success_after": heldout}

    # sync held-out 0.5 and 0.7: mean 0.6, sd 0.1414; above the sync mean is always within
    summary = summarize([run("sync", 0, 0.5), run("sync", 0, 0.7), run("eta1", 1, 0.46), run("eta2", 2, 0.45),
                         run("eta4", 4, 0.9)])
    assert summary["sync"]["heldout_std"] == pytest.approx(0.141421, abs=1e-6)
    assert summary["eta1"]["heldout_within_sync_sd"] and summary["eta4"]["heldout_within_sync_sd"]
    assert not summary["eta2"]["heldout_within_sync_sd"]  # 0.15 below


def test_sampled_validation_and_the_correction_reach_the_train_config():
    from agentrl.config import load_config

    args = _args(val_n=4, val_size=32, val_temperature=1.0, correction="decoupled", stale_groups="wait")
    cfg = load_config("train", overrides(eta=2, partial=True, seed=0, args=args), check_files=False)
    assert (cfg.rollout.val_n, cfg.rollout.val_temperature, cfg.data.task_val_size) == (4, 1.0, 32)
    assert (cfg.actor.rollout_correction.method, cfg.actor.rollout_correction.level) == ("decoupled", "token")
    assert cfg.rollout.stale_groups == "wait"
    sync = load_config("train", overrides(eta=0, partial=False, seed=0, args=args), check_files=False)
    assert sync.actor.rollout_correction.level is None and sync.rollout.val_n == 4


def test_configurations_alternate_their_order_from_seed_to_seed():
    assert run_order(["sync", "eta1", "eta4"], [0, 1, 2]) == [
        (0, "sync"), (0, "eta1"), (0, "eta4"), (1, "eta4"), (1, "eta1"), (1, "sync"), (2, "sync"), (2, "eta1"), (2, "eta4")]


def test_the_warm_start_replaces_the_base_model_of_every_configuration():
    from agentrl.config import load_config

    cfg = load_config("train", overrides(eta=1, partial=False, seed=0, args=_args(warm_start="/w/sft_policy")),
                      check_files=False)
    assert (cfg.model.path, cfg.sft.enable) == ("/w/sft_policy", False)
    assert load_config("train", overrides(eta=1, partial=False, seed=0, args=_args()), check_files=False).model.path is None


def test_the_reward_by_policy_version_keeps_the_versions_whose_samples_all_ended():
    samples = [(0, 1.0), (0, 0.0), (1, 0.5), (None, 1.0), (3, 1.0), (2, 0.25)]  # None: a sample without versions
    assert reward_by_version(samples, complete_up_to=2) == {0: 0.5, 1: 0.5, 2: 0.25}
    # 12 steps: synchronous step 12 trains version 11's samples; at eta 4 version 7's could still be
    # in flight at the last step (trained there, or dropped at a step that never comes)
    assert (last_complete_version(12, 0), last_complete_version(12, 1), last_complete_version(12, 4)) == (11, 9, 6)


def test_the_reward_at_the_same_versions_compares_the_versions_every_run_has():
    def run(config, eta, by_version):
        return {"config": config, "eta": eta, "trajectories_per_s": 1.0, "tokens_per_s": 1.0, "reward_per_sample": 0.5,
                "reward_by_version": by_version}

    sync = [run("sync", 0, {0: 0.2, 1: 0.4, 2: 0.6}), run("sync", 0, {0: 0.2, 1: 0.2, 2: 0.2})]
    # versions 0 and 1 in every run: sync per run 0.3 and 0.2 (mean 0.25, sd 0.0707); eta1 0.3 and 0.3
    summary = summarize(sync + [run("eta1", 1, {0: 0.2, 1: 0.4}), run("eta1", 1, {0: 0.4, 1: 0.2}),
                                run("eta4", 4, {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.9}), run("eta4", 4, {0: 0.1, 1: 0.0, 2: 0.2})])
    same = summary["eta1"]["reward_same_versions"]
    assert same["versions"] == [0, 1] and same["mean"] == pytest.approx(0.3) and same["std"] == pytest.approx(0.0)
    assert same["sync_mean"] == pytest.approx(0.25) and same["sync_std"] == pytest.approx(0.0707107, abs=1e-6)
    assert same["within_sync_sd"]  # 0.05 above, one sd 0.0707
    # versions 0 to 2 (3 is in one run only): sync 0.4 and 0.2 (mean 0.3, sd 0.1414); eta4 0.1 and 0.1
    lagging = summary["eta4"]["reward_same_versions"]
    assert lagging["versions"] == [0, 2] and lagging["sync_mean"] == pytest.approx(0.3)
    assert lagging["mean"] == pytest.approx(0.1) and not lagging["within_sync_sd"]  # 0.2 below
    assert summary["sync"].get("reward_same_versions") is None
    without = summarize([run("sync", 0, {}), run("eta1", 1, {0: 0.2})])  # runs without a store: nothing to compare
    assert without["eta1"]["reward_same_versions"] is None


def test_the_compute_workload_runs_sync_eta1_and_eta4_with_the_latency_on_and_off_on_the_word_problems():
    from agentrl.config import load_config
    from agentrl_benchmarks.async_training import apply_workload, configurations

    args = apply_workload(_args(workload="compute", etas=None, partial=None, seeds=None, steps=None, latency=None))
    assert (args.etas, args.partial, args.seeds, args.steps, args.latency) == ("1,4", "on", "0,1", 8, "on,off")
    assert apply_workload(_args(workload="calculator", etas="2", partial=None, seeds=None, steps=3, latency=None)).partial == "off,on"
    assert configurations(args.etas, args.partial, args.latency) == [
        ("sync", 0, False, "on"), ("eta1_partial", 1, True, "on"), ("eta4_partial", 4, True, "on"),
        ("sync_nolat", 0, False, "off"), ("eta1_partial_nolat", 1, True, "off"), ("eta4_partial_nolat", 4, True, "off")]
    with pytest.raises(SystemExit, match="--latency must be on, off or on,off, got 'slow'"):
        configurations("1", "on", "slow")
    off = load_config("train", overrides(eta=4, partial=True, seed=1, args=args, latency=False), check_files=False)
    assert (off.data.task, off.algorithm.grpo_turn_credit, off.rollout.max_staleness, off.rollout.partial) == (
        "word_steps", True, 4, True)
    assert off.agent.tool_config["calculator"] == {"latency_median_s": 0.0, "latency_p99_s": 6.2, "latency_seed": 1}
    assert not off.trainer.final_validation and not off.trainer.save_rollouts  # speed only: no store, no validation
    on = load_config("train", overrides(eta=0, partial=False, seed=1, args=args), check_files=False)
    assert on.agent.tool_config["calculator"]["latency_median_s"] == 0.3 and on.model.tiny.skills == "calculator"


def test_the_compute_summary_holds_eta4_to_the_latency_off_ceiling():
    def run(config, eta, latency, per_s, steady, end_to_end, cpu):
        return {"config": config, "eta": eta, "latency": latency, "trajectories_per_s": per_s, "tokens_per_s": 1.0,
                "reward_per_sample": 0.0, "steady_trajectories_per_s": steady,
                "end_to_end_trajectories_per_s": end_to_end, "cpu_s_per_trajectory": cpu}

    summary = summarize([run("sync", 0, "on", 4.0, 4.0, 2.0, 0.5), run("sync_nolat", 0, "off", 20.0, 25.0, 10.0, 0.5),
                         run("sync_nolat", 0, "off", 20.0, 15.0, 10.0, 0.5),
                         run("eta4_partial", 4, "on", 16.0, 18.0, 6.0, 0.6), run("eta1_partial_nolat", 1, "off", 18.0, 18.0, 9.0, 0.5),
                         run("eta4_partial_nolat", 4, "off", 19.0, 24.0, 8.0, 0.75)])
    lat, nolat = summary["eta4_partial"], summary["eta4_partial_nolat"]
    assert (lat["speedup"], lat["x_ceiling"], lat["floor"], lat["meets_floors"]) == (4.0, 0.8, 0.8, True)
    assert (nolat["speedup"], nolat["x_ceiling"], nolat["floor"], nolat["meets_floors"]) == (0.95, 0.95, 0.95, True)
    assert (nolat["steady_speedup"], nolat["end_to_end_speedup"], nolat["cpu_ratio"]) == (1.2, 0.8, 1.5)
    assert lat["steady_x_ceiling"] == 0.9 and lat["end_to_end_x_ceiling"] == 0.6
    assert summary["sync"]["x_ceiling"] == 0.2 and summary["sync_nolat"]["speedup"] == 1.0
    assert "floor" not in summary["eta1_partial_nolat"] and summary["eta1_partial_nolat"]["speedup"] == 0.9
    slower = summarize([run("sync_nolat", 0, "off", 20.0, 20.0, 10.0, 0.4), run("eta4_partial_nolat", 4, "off", 18.0, 18.0, 9.0, 0.6)])
    assert slower["eta4_partial_nolat"]["x_ceiling"] == 0.9 and not slower["eta4_partial_nolat"]["meets_floors"]


def test_a_run_reports_its_steady_speed_and_episode_shape():
    rows = [{"timing/step_s": 4.0, "tokens/per_s": 1.0, "reward/mean": 0.0, "response_length/mean": 120.0, "tool_calls/mean": 2.0},
            {"timing/step_s": 2.0, "tokens/per_s": 1.0, "reward/mean": 0.0, "response_length/mean": 140.0, "tool_calls/mean": 3.0},
            {"timing/step_s": 2.0, "tokens/per_s": 1.0, "reward/mean": 0.0, "response_length/mean": 130.0, "tool_calls/mean": 2.5}]
    run = summarize_run(rows, eta=0, samples_per_step=8)
    assert (run["trajectories_per_s"], run["steady_trajectories_per_s"]) == (24 / 8, 16 / 4)
    assert (run["response_length"], run["tool_calls"]) == (130.0, 2.5)
    assert summarize_run(rows[:1], eta=0, samples_per_step=8)["steady_trajectories_per_s"] is None

"""`agentrl bench scaling`: one real training point (the 1M model, two steps, a process of its
own that reports its peak memory), the slope of memory over trajectories in flight, the plots
and the option checks. The figures themselves: docs/benchmarks.md."""

from __future__ import annotations

import re

import pytest

from agentrl_benchmarks.scaling import _slope, _train_point, main, write_plots


def test_a_training_point_reports_its_step_time_memory_and_work(tmp_path):
    point = _train_point(tmp_path, "p", 2, ["model.tiny.size=1m", "model.tiny.skills=none", "rollout.n=2",
                                            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                            "actor.ppo_micro_batch_size_per_gpu=2", "rollout.max_new_tokens=8",
                                            "data.max_response_length=32"])
    assert point["parameters"] == 874_624  # the 1m shape, tied embedding counted once
    assert 0 < point["step_s"] < 60 and 200 < point["peak_rss_mib"] < 8000
    assert 0 < point["tokens_sampled"] <= 4 * 8 and point["turns_mean"] >= 1


def test_memory_per_trajectory_is_the_slope_over_the_counts():
    assert _slope([1, 16, 64], [100.0, 115.0, 163.0]) == pytest.approx(1.0)


def test_the_plots_hold_every_point(tmp_path):
    out = {
        "model_size": [{"parameters": p, "step_s": s, "peak_rss_mib": m} for p, s, m in
                       [(0.87e6, 0.1, 900), (18e6, 0.5, 1500), (105e6, 4.0, 4000)]],
        "group_size": [{"n": n, "step_s": 0.1 * n} for n in (2, 4, 8, 16)],
        "turns": [{"turns_mean": t, "step_s": 0.2 * t} for t in (1.0, 1.9, 3.2)],
        "rollout_memory": [{"in_flight": c, "peak_rss_mib": 100 + c} for c in (1, 16, 64)],
    }
    paths = write_plots(out, tmp_path)
    assert sorted(p.name for p in paths) == ["scaling-group-size.svg", "scaling-in-flight.svg", "scaling-model-size.svg",
                                             "scaling-turns.svg"]
    model = (tmp_path / "scaling-model-size.svg").read_text()
    assert model.startswith("<svg xmlns=\"http://www.w3.org/2000/svg\"")  # renders as an image file
    assert model.count("<polyline") == 2 and model.count("<circle") == 6 and "M params 0.87" in model
    assert (tmp_path / "scaling-group-size.svg").read_text().count("<circle") == 4
    points = re.findall(r'points="([^"]+)"', (tmp_path / "scaling-in-flight.svg").read_text())
    assert len(points) == 1 and len(points[0].split()) == 3


def test_one_step_cannot_be_timed():
    with pytest.raises(SystemExit) as exited:
        main(["--steps", "1"])
    assert exited.value.code == 2

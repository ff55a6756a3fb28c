"""``agentrl bench engine``'s driver: repeats alternate the engines' order and report the median run."""

from __future__ import annotations

import pytest

from agentrl_benchmarks import engine as engine_bench


def test_repeats_alternate_the_order_and_keep_the_median_run(monkeypatch, tmp_path):
    calls: list[str] = []
    # tokens/s of each engine's successive runs: the median is not the first, the last or the mean
    speeds = {"builtin": iter([300.0, 100.0, 200.0] * 2), "hf_static": iter([50.0, 70.0, 60.0] * 2)}

    def runner(name):
        def run(model, sessions, concurrency):
            calls.append(name)
            return 1000, 1000 / next(speeds[name]), len(sessions), [0.01], {}
        return run

    class FakeConfig:
        vocab_size = 100

    class FakeModel:
        config = FakeConfig()

        def parameters(self):
            return []

    monkeypatch.setattr(engine_bench, "build_model", lambda size: FakeModel())
    monkeypatch.setattr(engine_bench, "measure_matmul_gflops", lambda: 100.0)
    monkeypatch.setattr(engine_bench, "decode_step_anatomy", lambda *a, **k: [])
    monkeypatch.setattr(engine_bench, "run_builtin", runner("builtin"))
    monkeypatch.setattr(engine_bench, "run_hf_static", runner("hf_static"))
    args = engine_bench.argparse.Namespace(
        threads=1, engines=["builtin", "hf_static"], models=["1m"], concurrency=[2], quick=True, seed=0, repeats=3
    )
    report = engine_bench.run_benchmark(args, tmp_path)
    per_workload = ["builtin", "hf_static", "hf_static", "builtin", "builtin", "hf_static"]
    assert calls == per_workload * 2  # multi-turn, then decode-only
    rows = {(r["engine"], r["workload"]): r for r in report["results"]}
    assert rows["builtin", "multi_turn"]["tokens_per_s"] == pytest.approx(200.0)
    assert rows["builtin", "multi_turn"]["extra"]["tokens_per_s_all"] == pytest.approx([300.0, 100.0, 200.0])
    assert rows["hf_static", "decode_only"]["tokens_per_s"] == pytest.approx(60.0)
    assert report["workload"]["repeats"] == 3

"""``agentrl bench engine``'s driver: repeats alternate the engines' order and report the median run."""

from __future__ import annotations

import pytest

from agentrl_benchmarks import engine as engine_bench


def test_repeats_alternate_the_order_and_keep_the_median_run(monkeypatch, tmp_path):
    calls: list[str] = []
    # tokens/s of each engine's successive runs: the median is not the first, the last or the mean
    speeds = {"builtin": iter([300.0, 100.0, 200.0] * 2), "hf_static": iter([50.0, 70.0, 60.0] * 2)}

    def runner(name):
        def run(model, sessions, concurrency, *machine):
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


# ---------------------------------------------------------------------- the roofline (issue #49)

from agentrl_benchmarks import roofline as rl  # noqa: E402

# 2 layers, hidden 8, 2 query heads and 1 K/V head of 4, SwiGLU 16, vocabulary 10, tied, q/k/v biases
SHAPE = rl.ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tied=True, qkv_bias=True)


def test_step_cost_is_the_hand_computed_bytes_and_flops():
    # one layer's matrices: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each = 576 elements;
    # its vectors: 2 norms of 8 and q/k/v biases 8+4+4 = 32; the model: 2 x 608 + final norm 8 +
    # LM head (= the tied embedding) 80 = 1,304 elements = 5,216 bytes
    assert (SHAPE.layer_linear_weights, SHAPE.layer_other_weights) == (576, 32)
    # a step of 2 decode rows at positions 3 and 5 (4 + 6 keys) and a prefill span of 3 tokens
    # after a reused prefix of 2 (5 keys; pairs 3 + 4 + 5 = 12): 5 tokens, 3 logit rows
    cost = rl.step_cost(SHAPE, tokens=5, logit_rows=3, kv_positions=15, attended_pairs=22)
    assert cost.weight_bytes == 5216
    assert SHAPE.kv_bytes_per_position == 64  # K and V x 2 layers x 1 head x 4 x 4 bytes
    assert (cost.kv_read_bytes, cost.kv_write_bytes, cost.bytes) == (960, 320, 6496)
    # linears 2 x 5 tokens x 2 layers x 576 + LM head 2 x 3 rows x 80; attention 4 x 4 x 2 heads x 2 layers x 22
    assert (cost.linear_flops, cost.attention_flops, cost.flops) == (12000, 1408, 13408)
    # the roofline is the larger of memory time and compute time
    memory_bound = rl.Machine(stream_gbps=6496e-9, matmul_gflops=13408e-9 / 0.5)  # 1 s of bytes, 0.5 s of FLOPs
    assert rl.roofline_s(cost, memory_bound) == pytest.approx(1.0)
    compute_bound = rl.Machine(stream_gbps=6496e-9 / 0.25, matmul_gflops=13408e-9 / 2)
    assert rl.roofline_s(cost, compute_bound) == pytest.approx(2.0)
    untied = rl.ModelShape(**{**SHAPE.__dict__, "tied": False})
    assert rl.step_cost(untied, tokens=5, logit_rows=3, kv_positions=15, attended_pairs=22).weight_bytes == 5216 + 5 * 8 * 4


def test_engine_steps_record_what_attention_reads_and_the_run_roofline_adds_them():
    import asyncio

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.builtin import BuiltinEngine

    torch = engine_bench.torch
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=10, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    assert rl.ModelShape.of(config) == SHAPE
    assert sum(p.numel() for p in model.parameters()) == 1304  # the hand count above is the model's
    engine = BuiltinEngine(model, max_batch_size=2, step_log_size=None, steps_on="event_loop")
    prompt = [1, 2, 3, 4, 5]

    async def conversation():
        first = await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=3, temperature=0.0)))
        # the next turn: its first 7 positions' K/V are in the finished request's slot
        await engine.generate(GenerateRequest(prompt + first.output_ids + [6, 7], SamplingParams(max_new_tokens=1, temperature=0.0)))

    try:
        asyncio.run(conversation())
        records = list(engine.step_log)
    finally:
        engine.close()
    # prefill of 5 (keys 1..5: 15 pairs), decodes at positions 5 and 6, the next turn's 3 new tokens after 7 reused
    assert [(r.prefill_tokens, r.reused_tokens, r.kv_positions, r.attended_pairs) for r in records] == [
        (5, 0, 5, 15), (0, 0, 6, 6), (0, 0, 7, 7), (3, 7, 10, 3 * 7 + 6)]
    machine = rl.Machine(stream_gbps=1.0, matmul_gflops=1.0)
    run = rl.run_roofline(SHAPE, machine, records, wall_s=2.0, full_rows=1)
    costs = [rl.step_cost(SHAPE, tokens=5, logit_rows=1, kv_positions=5, attended_pairs=15),
             rl.step_cost(SHAPE, tokens=1, logit_rows=1, kv_positions=6, attended_pairs=6),
             rl.step_cost(SHAPE, tokens=1, logit_rows=1, kv_positions=7, attended_pairs=7),
             rl.step_cost(SHAPE, tokens=3, logit_rows=1, kv_positions=10, attended_pairs=27)]
    assert (run["bytes"], run["flops"]) == (sum(c.bytes for c in costs), sum(c.flops for c in costs))
    roof = sum(rl.roofline_s(c, machine) for c in costs)
    assert run["roofline_s"] == pytest.approx(roof, abs=1e-4)
    assert run["fraction_of_wall"] == pytest.approx(roof / 2.0, abs=1e-4)
    # the decode-only steps (the second and third), each over its period to the next step's start
    decode = run["decode_steps"]
    assert decode["steps"] == 2 and decode["mean_context"] == 6.5
    decode_roof = rl.roofline_s(costs[1], machine) + rl.roofline_s(costs[2], machine)
    assert decode["roofline_ms"] == pytest.approx(decode_roof / 2 * 1e3, abs=1e-3)
    assert decode["fraction"] == pytest.approx(decode_roof / (records[3].started - records[1].started), abs=1e-4)

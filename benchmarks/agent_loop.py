"""``agentrl bench agent-loop --json``: the agent layer's own cost, engine excluded.

The scripted engine answers instantly with a tool call for the first turns and a final answer
for the last, so everything measured is the layer: loop selection, generate-request building,
parsing, argument validation, tool execution (the calculator), chat-template deltas,
tokenization, limits, trajectory assembly and rewards. Prints one JSON object:

    turns_per_s          tool-using assistant turns completed per second (one process)
    overhead_p50_ms      per-turn layer time, median and 99th percentile: the time between a
    overhead_p99_ms      turn's generate returning and the next generate being issued, measured
                         with one trajectory at a time so no other trajectory's work is counted
    inflight_max         the most trajectories in flight at once
    rss_mib_at_inflight_max  resident memory when that many were in flight
    settings             what was run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
from typing import Any

__all__ = ["main", "run_benchmark"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _TimingEngine:
    """Wraps the scripted engine: records when each generate returns and when the next starts,
    and holds every trajectory's first call until all are in flight (to measure memory then)."""

    def __init__(self, inner: Any, hold_until: int):
        self.inner = inner
        self.last_return: dict[str, float] = {}
        self.gaps: list[float] = []
        self.hold_until = hold_until
        self.waiting = 0
        self.release = asyncio.Event()
        self.rss_at_peak = 0.0

    async def generate(self, request):
        session = request.session_id
        now = time.perf_counter()
        if session in self.last_return:
            self.gaps.append(now - self.last_return[session])
        elif not self.release.is_set():
            self.waiting += 1
            if self.waiting >= self.hold_until:
                self.rss_at_peak = _rss_mib()
                self.release.set()
            else:
                await self.release.wait()
        result = await self.inner.generate(request)
        self.last_return[session] = time.perf_counter()
        return result

    async def abort(self, rid):
        return None

    async def update_weights(self, state_dict=None, *, path=None, version=None):
        return None

    async def health(self):
        return True


def run_benchmark(*, trajectories: int, tool_turns: int, concurrency: int, inflight: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import AgentConfig, DataConfig, TrainConfig
    from agentrl.data.dataset import rows_from_dicts
    from agentrl.tiny import tiny_model_dir
    from agentrl_data_prep.tasks import generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("1m"))
    calls = [
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{100 + i} * {37 + i}"}}}}\n</tool_call>'
        for i in range(tool_turns)
    ]
    script = lambda row_id, index, request: calls[index] if index < tool_turns else "#### 42"  # noqa: E731
    rollout_setup = RolloutSetup.from_config(
        TrainConfig(agent=AgentConfig(max_assistant_turns=tool_turns + 1), data=DataConfig(max_response_length=4096))
    )

    def setup(hold: int):
        engine = _TimingEngine(ScriptedEngine(tokenizer, script, record_requests=False), hold_until=hold)
        ctx = build_context(engine, tokenizer, rollout_setup)
        return engine, ctx

    # warm-up rows (own ids, so the script starts afresh for the measured rows): the first
    # trajectories fill the layer's caches (template shapes, token pieces, validators)
    warmup = [(f"warmup:{i}", row) for i, (_, row) in enumerate(rows_from_dicts(generate("arith", 200, seed=3)))]

    # 1) throughput at a working concurrency
    rows = rows_from_dicts(generate("arith", trajectories, seed=0))
    engine, ctx = setup(hold=1)
    runner = RolloutRunner(ctx, LoopTable("tool_agent"), max_concurrency=concurrency)
    asyncio.run(runner.run(warmup, n=1))
    start = time.perf_counter()
    done = asyncio.run(runner.run(rows, n=1))
    wall = time.perf_counter() - start
    turns = sum(t.metrics["turns"] for t in done)
    tool_turns_done = sum(t.metrics.get("tool_calls", 0) for t in done)

    # per-turn overhead without queueing behind other trajectories: one at a time
    sequential = rows_from_dicts(generate("arith", min(trajectories, 300), seed=2))
    engine_seq, ctx_seq = setup(hold=1)
    sequential_runner = RolloutRunner(ctx_seq, LoopTable("tool_agent"), max_concurrency=1)
    asyncio.run(sequential_runner.run(warmup, n=1))
    engine_seq.gaps.clear()
    asyncio.run(sequential_runner.run(sequential, n=1))
    gaps_ms = sorted(g * 1000 for g in engine_seq.gaps)

    # 2) many trajectories in flight at once: memory at the peak
    many = rows_from_dicts(generate("arith", inflight, seed=1))
    engine2, ctx2 = setup(hold=inflight)
    runner2 = RolloutRunner(ctx2, LoopTable("tool_agent"), max_concurrency=inflight)
    asyncio.run(runner2.run(many, n=1))

    return {
        "turns_per_s": round(turns / wall, 1),
        "tool_turns_per_s": round(tool_turns_done / wall, 1),
        "overhead_p50_ms": round(statistics.median(gaps_ms), 3),
        "overhead_p99_ms": round(gaps_ms[int(0.99 * (len(gaps_ms) - 1))], 3),
        "inflight_max": runner2.inflight_max,
        "rss_mib_at_inflight_max": round(engine2.rss_at_peak, 1),
        "settings": {
            "trajectories": trajectories,
            "tool_turns_per_trajectory": tool_turns,
            "turns_per_trajectory": tool_turns + 1,
            "concurrency": concurrency,
            "inflight_trajectories": inflight,
            "engine": "scripted (instant)",
            "tool": "calculator",
            "wall_s": round(wall, 3),
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench agent-loop")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--tool-turns", type=int, default=3, help="tool-calling turns before the final answer")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--inflight", type=int, default=10000)
    parser.add_argument("--quick", action="store_true", help="small settings for a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.trajectories, args.inflight = 200, 500
    result = run_benchmark(
        trajectories=args.trajectories, tool_turns=args.tool_turns, concurrency=args.concurrency, inflight=args.inflight
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0

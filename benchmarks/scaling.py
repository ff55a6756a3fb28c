"""``agentrl bench scaling``: how a training step's time and a job's memory grow.

Each training point is one ``agentrl train`` process of ``--steps`` GRPO steps on the arithmetic
tool task (one rank, so the groups run in the process and its peak resident memory is the
whole job's: model, engine, optimizer, activations, interpreter). ``step_s`` is the median wall
time of the steps after the first (rollout, rewards, logprobs, update, weight sync), ``peak_rss_mib``
the process's peak, ``tokens_sampled`` the tokens a step's rollout generated. Three axes:

* model size: the tiny Qwen2 shapes ``1m``, ``18m`` and ``100m`` (built from their configs,
  untrained: every answer runs to the turn's token budget, so each point does the same work),
  ``--prompts`` x ``--n`` trajectories a step;
* group size: ``rollout.n`` 2, 4, 8, 16 on the 18M model;
* turns: the calculator-skilled 1M base (shipped) on the multi-step word problems, with
  ``agent.max_assistant_turns`` 1, 2 and 4; the turns each trajectory really took are reported.

Besides, rollout memory per trajectory in flight: the built-in engine (18M model) answering 1, 16
and 64 requests at once (64-token prompts, 64 new tokens each, no stop token), each count in a
process of its own; ``per_trajectory_mib`` is the slope of peak memory over the count.

Prints one JSON object; ``--plot DIR`` also writes ``DIR/scaling-*.svg`` (the plots in
docs/benchmarks.md).

    agentrl bench scaling --json [--steps 4] [--plot docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentrl_benchmarks._scratch import scratch_dir

__all__ = ["main"]

SIZES = ("1m", "18m", "100m")
GROUP_SIZES = (2, 4, 8, 16)
TURN_LIMITS = (1, 2, 4)
IN_FLIGHT = (1, 16, 64)

# the child reports its own peak memory when the job is done
_LAUNCHER = ("import resource, sys; from agentrl.cli import main; rc = main(sys.argv[1:]); "
             "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")


def _train_point(work: Path, name: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    args = [
        "train", "trainer=default", "sft.enable=false", f"trainer.total_steps={steps}", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.export_hf=false", "trainer.save_rollouts=false",
        "logging.progress=false", "logging.loggers=[jsonl]", f"trainer.runs_root={work}", f"trainer.run_name={name}",
        *overrides,
    ]
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *args], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"scaling point {name} failed:\n{done.stderr[-3000:]}")
    [peak] = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("peak_rss_kib")]
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "timing/step_s" in r]
    summary = json.loads((work / name / "summary.json").read_text())
    return {
        "step_s": statistics.median(r["timing/step_s"] for r in steps_rows[1:] or steps_rows),
        "peak_rss_mib": round(int(peak) / 1024, 1),
        "tokens_sampled": statistics.median(r["tokens/sampled"] for r in steps_rows),
        "turns_mean": statistics.mean(r["turns/mean"] for r in steps_rows),
        "parameters": summary.get("actor/parameters"),
        "startup_s": summary.get("startup/total_s"),
    }


def _in_flight_child(count: int) -> None:
    """In a process of its own: ``count`` requests at once through the built-in engine."""
    import asyncio
    import resource

    import torch

    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.builtin import BuiltinEngine
    from agentrl.tiny import tiny_model_dir

    torch.manual_seed(0)
    model = tiny_model_dir("18m")

    async def run() -> None:
        async with BuiltinEngine(model, max_batch_size=max(IN_FLIGHT), seed=0) as engine:
            g = torch.Generator().manual_seed(1)
            requests = [GenerateRequest(torch.randint(10, 200, (64,), generator=g).tolist(),
                                        SamplingParams(max_new_tokens=64, temperature=1.0, stop_token_ids=(), seed=i))
                        for i in range(count)]
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            assert all(len(r.output_ids) == 64 for r in results)

    asyncio.run(run())
    print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _in_flight_point(count: int) -> float:
    done = subprocess.run([sys.executable, "-m", "agentrl_benchmarks.scaling", "--in-flight-child", str(count)],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the engine with {count} requests in flight failed:\n{done.stderr[-3000:]}")
    [peak] = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("peak_rss_kib")]
    return round(int(peak) / 1024, 1)


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def measure(work: Path, steps: int, prompts: int, n: int) -> dict[str, Any]:
    common = [f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", "rollout.max_new_tokens=32",
              "data.max_response_length=96"]
    out: dict[str, Any] = {"settings": {"steps": steps, "prompts": prompts, "n": n}}

    def progress(text: str) -> None:
        print(f"# {text}", file=sys.stderr, flush=True)

    def sampled(group: int) -> list[str]:  # a group's trajectories in one micro-batch
        return [f"rollout.n={group}", f"actor.ppo_micro_batch_size_per_gpu={group}"]

    axes = {
        "model_size": [("size", size, [f"model.tiny.size={size}", "model.tiny.skills=none", *sampled(n)]) for size in SIZES],
        "group_size": [("n", group, ["model.tiny.size=18m", "model.tiny.skills=none", *sampled(group)]) for group in GROUP_SIZES],
        "turns": [("max_assistant_turns", limit, ["data=word", "model.tiny.skills=calculator", *sampled(n),
                                                  f"agent.max_assistant_turns={limit}"]) for limit in TURN_LIMITS],
    }
    for axis, points in axes.items():
        out[axis] = []
        for key, value, overrides in points:
            progress(f"{axis}: {key}={value}")
            out[axis].append({key: value, **_train_point(work, f"{axis}-{value}", steps, overrides + common)})
    out["rollout_memory"] = []
    for count in IN_FLIGHT:
        progress(f"{count} trajectories in flight")
        out["rollout_memory"].append({"in_flight": count, "peak_rss_mib": _in_flight_point(count)})
    memory = out["rollout_memory"]
    out["per_trajectory_mib"] = round(_slope([p["in_flight"] for p in memory], [p["peak_rss_mib"] for p in memory]), 3)
    return out


def write_plots(out: dict[str, Any], directory: Path) -> list[Path]:
    from agentrl.report import _svg

    directory.mkdir(parents=True, exist_ok=True)
    plots = {
        "scaling-model-size.svg": _svg("step s and peak GiB vs parameters (millions)", {
            "step s": [(p["parameters"] / 1e6, p["step_s"]) for p in out["model_size"]],
            "peak GiB": [(p["parameters"] / 1e6, p["peak_rss_mib"] / 1024) for p in out["model_size"]]}, x_label="M params"),
        "scaling-group-size.svg": _svg("18M: step s vs rollout.n", {
            "step s": [(p["n"], p["step_s"]) for p in out["group_size"]]}, x_label="n"),
        "scaling-turns.svg": _svg("1M: step s vs turns per trajectory", {
            "step s": [(p["turns_mean"], p["step_s"]) for p in out["turns"]]}, x_label="turns"),
        "scaling-in-flight.svg": _svg("18M engine: peak MiB vs trajectories in flight", {
            "peak MiB": [(p["in_flight"], p["peak_rss_mib"]) for p in out["rollout_memory"]]}, x_label="in flight"),
    }
    paths = []
    for name, svg in plots.items():
        # a file of its own (an <img> or a Markdown image) needs the namespace that inline SVG does not
        (directory / name).write_text(svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1) + "\n")
        paths.append(directory / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per point (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (the model-size and turns axes)")
    parser.add_argument("--plot", type=Path, help="write the plots (SVG) into this directory")
    parser.add_argument("--keep", help="keep the work directory here instead of a temporary one")
    parser.add_argument("--in-flight-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_flight_child:
        _in_flight_child(args.in_flight_child)
        return 0
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step is not timed), got {args.steps}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with scratch_dir("scaling", keep=args.keep) as work:
        out = measure(work, args.steps, args.prompts, args.n)
    if args.plot:
        out["plots"] = [str(p) for p in write_plots(out, args.plot)]
    if not args.json:
        for p in out["model_size"]:
            print(f"{p['size']:>5}: {p['step_s']:.2f} s/step, peak {p['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``agentrl bench async --json``: the synchronous trainer against asynchronous training.

The task is the quickstart's arithmetic with the calculator tool, whose calls wait a heavy-tailed
time (``agent.tool_config.calculator.latency_*``: lognormal, median and 99th percentile set by
``--latency-median-s`` / ``--latency-p99-s``), episodes of 1 to ``--max-turns`` assistant turns.
Each configuration is one ``agentrl train`` in a subprocess, same model, data, seeds and number of
samples: the synchronous trainer (``rollout.max_staleness=0``) and every eta of ``--etas`` with
partial rollouts off and on (``rollout.partial``), truncated importance sampling on.

Prints one JSON object: ``runs`` (one per configuration and seed: trajectories/s and tokens/s
over the training steps' wall time, the trainer's idle fraction, the engine's busy fraction,
the staleness histogram, and reward against samples and against wall-clock per step),
``summary`` (per configuration: the means over seeds, the speed-up over the synchronous run,
the mean reward per sample and its standard deviation over seeds) and ``settings``.
``--beside-cpu-job`` runs a busy process beside every run (two jobs sharing the cores);
``--threads`` sets every run's ``OMP_NUM_THREADS`` (default 1: torch's spin-waiting thread teams
slow a step many times over when another job shares the cores, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "overrides", "summarize_run", "summarize"]


def overrides(*, eta: int, partial: bool, seed: int, args: argparse.Namespace) -> list[str]:
    """The ``agentrl train`` overrides of one configuration."""
    calc = "agent.tool_config.calculator"
    out = [
        f"trainer.total_steps={args.steps}", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.export_hf=false",
        "trainer.val_before_train=false", "trainer.save_rollouts=false", "logging.progress=false",
        f"data.train_batch_size={args.batch_size}", f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.batch_size}",
        f"actor.ppo_micro_batch_size_per_gpu={math.gcd(8, args.batch_size * args.n)}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"data.max_response_length={args.max_response_length}",
        f"agent.max_assistant_turns={args.max_turns}", f"sft.enable={str(args.sft).lower()}",
        f"+{calc}.latency_median_s={args.latency_median_s}", f"+{calc}.latency_p99_s={args.latency_p99_s}",
        f"+{calc}.latency_seed={seed}", f"trainer.seed={seed}", f"rollout.max_staleness={eta}",
    ]
    if eta > 0:
        out += [f"rollout.partial={str(partial).lower()}", "actor.rollout_correction.level=token"]
    return out


def summarize_run(rows: list[dict[str, Any]], *, eta: int, samples_per_step: int) -> dict[str, Any]:
    """One run's figures from its training steps' metrics rows."""
    wall = sum(r["timing/step_s"] for r in rows)
    tokens = sum(r["tokens/per_s"] * r["timing/step_s"] for r in rows)
    idle = [r.get("async/trainer_idle_fraction", r.get("timing/rollout_s", 0.0) / r["timing/step_s"]) for r in rows]
    busy = [r["engine/busy_fraction"] for r in rows if "engine/busy_fraction" in r]
    hist = {k: sum(r.get(f"async/staleness_hist/{k}", 0.0) for r in rows) for k in range(eta + 1)} if eta else {
        0: float(samples_per_step * len(rows))}
    elapsed, curve = 0.0, []
    for i, r in enumerate(rows):
        elapsed += r["timing/step_s"]
        curve.append({"step": i + 1, "samples": (i + 1) * samples_per_step, "wall_s": elapsed, "reward": r["reward/mean"]})
    return {
        "steps": len(rows), "wall_s": wall, "trajectories_per_s": samples_per_step * len(rows) / wall,
        "tokens_per_s": tokens / wall, "trainer_idle_fraction": statistics.fmean(idle),
        "engine_busy_fraction": statistics.fmean(busy) if busy else None, "staleness_hist": hist,
        "reward_per_sample": statistics.fmean(r["reward/mean"] for r in rows),
        "interrupted_requests": sum(r.get("engine/interrupted_requests", 0.0) for r in rows),
        "dropped_groups": sum(r.get("async/dropped_groups", 0.0) for r in rows), "curve": curve,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: means over seeds, speed-up over the synchronous configuration."""
    by: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by.setdefault(run["config"], []).append(run)
    out: dict[str, Any] = {}
    for name, group in by.items():
        rewards = [g["reward_per_sample"] for g in group]
        out[name] = {"trajectories_per_s": statistics.fmean(g["trajectories_per_s"] for g in group),
                     "tokens_per_s": statistics.fmean(g["tokens_per_s"] for g in group),
                     "reward_per_sample": statistics.fmean(rewards),
                     "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0, "seeds": len(group)}
    sync = out.get("sync")
    for name, s in out.items():
        s["speedup"] = s["trajectories_per_s"] / sync["trajectories_per_s"] if sync else None
    return out


def _train(args: argparse.Namespace, name: str, extra: list[str], root: Path) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    if args.threads:  # torch's intra-op threads: spin-waiting teams collapse on a shared machine
        env["OMP_NUM_THREADS"] = str(args.threads)
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *extra, f"trainer.runs_root={root}",
                           f"trainer.run_name={name}"], capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"agentrl train ({name}) failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench async", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    parser.add_argument("--etas", default="1,2,4", help="max_staleness values to run beside the synchronous trainer")
    parser.add_argument("--partial", default="off,on", help="partial rollouts for each eta: off, on or off,on")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (the issue's measurement uses 0,1,2)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-response-length", type=int, default=512)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--latency-median-s", type=float, default=0.3)
    parser.add_argument("--latency-p99-s", type=float, default=6.2)
    parser.add_argument("--sft", action="store_true", help="keep the quickstart's SFT warm start (off: RL from the tiny base)")
    parser.add_argument("--beside-cpu-job", action="store_true", help="a busy process shares the cores with every run")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run (0: inherit)")
    args = parser.parse_args(argv)
    configs = [("sync", 0, False)] + [
        (f"eta{eta}" + ("_partial" if p == "on" else ""), eta, p == "on")
        for eta in (int(e) for e in args.etas.split(",") if e) for p in args.partial.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",")]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.beside_cpu_job else None
    runs = []
    try:
        from agentrl_benchmarks._scratch import scratch_dir

        with scratch_dir("agentrl-bench-async") as tmp:
            for seed in seeds:
                for name, eta, partial in configs:
                    start = time.perf_counter()
                    rows = _train(args, f"{name}-s{seed}", overrides(eta=eta, partial=partial, seed=seed, args=args), Path(tmp))
                    run = summarize_run(rows, eta=eta, samples_per_step=args.batch_size * args.n)
                    runs.append({"config": name, "eta": eta, "partial": partial, "seed": seed,
                                 "process_wall_s": time.perf_counter() - start, **run})
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings["cpu_count"] = os.cpu_count()
    print(json.dumps({"runs": runs, "summary": summarize(runs), "settings": settings}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``agentrl bench async --json``: the synchronous trainer against asynchronous training.

The task is the quickstart's arithmetic with the calculator tool, whose calls wait a heavy-tailed
time (``agent.tool_config.calculator.latency_*``: lognormal, median and 99th percentile set by
``--latency-median-s`` / ``--latency-p99-s``), episodes of 1 to ``--max-turns`` assistant turns.
Each configuration is one ``agentrl train`` in a subprocess, same model, data, seeds and number of
samples: the synchronous trainer (``rollout.max_staleness=0``) and every eta of ``--etas`` with
partial rollouts off and on (``rollout.partial``), truncated importance sampling on.

Prints one JSON object: ``runs`` (one per configuration and seed: trajectories/s and tokens/s
over the training steps' wall time, the trainer's idle fraction, the engine's busy fraction,
the staleness histogram, reward against samples and against wall-clock per step, and the held-out
success of the run's final validation: greedy, or sampled with ``--val-n`` answers a problem at
``--val-temperature``, which measures the policy after as many samples without the lag of stale
samples' training reward and without greedy's cliff),
``reward_by_version`` (the mean reward of the run's samples by the policy version that sampled
them, the oldest version among a sample's tokens, read from the run's rollout store: the versions
every sample of which was trained or dropped by the end, ``last_complete_version``),
``summary`` (per configuration: the means over seeds, the speed-up over the synchronous run,
the mean reward per sample and its standard deviation over seeds, the mean held-out success,
and ``reward_same_versions``: the reward per sample of the policies of the versions both it and
the synchronous runs have, against the synchronous runs' over the same versions)
and ``settings``.
``--sft``: every run starts from the quickstart's warm start (SFT on a demonstrator who seldom
calls the calculator, so RL has something to learn: calling it), built once and shared (or taken
from ``--warm-start DIR``); without it the runs start from the calculator-skilled base, which
already solves the task. Configurations run in the order listed for the first seed, reversed
for the next, and so on (a machine whose load drifts favours neither end).
``--beside-cpu-job`` runs a second CPU job beside every run (two jobs sharing the cores):
``busy``, one Python busy loop, or ``torch``, a matrix-product loop with torch's default thread
count; ``--threads`` sets every run's ``OMP_NUM_THREADS`` (default 1: torch's spin-waiting
thread teams slow a step many times over when another job shares the cores, docs/benchmarks.md).
``summary`` also says, per asynchronous configuration, whether it meets issue 36's floors
(``FLOORS``: eta 1 at least 1.5x the synchronous trajectories/s, eta 4 at least 2.5x; eta 2,
which the issue leaves out, is held to eta 1's), each with its reward per sample within one
standard deviation (the synchronous runs' over seeds) of the synchronous mean, and whether its
held-out success is no more than one synchronous standard deviation below the synchronous one.
A version's policy has taken as many updates, on as many samples, in every configuration: its
samples' reward measures what was learnt per sample without the lag of ``reward_per_sample``
(whose samples, in asynchronous training, come from policies up to eta versions older).
``--correction`` picks the asynchronous runs' off-policy correction (``tis`` or ``decoupled``),
``--stale-groups`` what they do with a group that finished too old (``drop``, the default, or ``wait``).

``--workload compute`` (issue 49): the compute-heavy preset. The calculator-skilled base on the
multi-step word problems (``data=word_steps``: two or three calculator calls a problem, each call
that reaches one of the problem's intermediate values rewarded on its turn, with
``algorithm.grpo_turn_credit=true``, so the samples of a group differ and every step has a gradient
to compute). Its responses are the model's own: a tool call a turn (about 30 tokens each) and the
calculator's results between them, 100 to 150 tokens an episode on average (50 to 200), 2 to 3
calls (the runs report ``response_length`` and ``tool_calls`` per episode). The synchronous run,
eta 1 and eta 4 (partial rollouts on) run with the latency on and off (``--latency on,off``: off is
``latency_median_s=0``, the compute ceiling), the configurations in alternating order over
``--seeds`` (the repeats). ``summary`` adds, per configuration, ``x_ceiling``: its trajectories/s
over the synchronous latency-off run's; its ``speedup`` is over the synchronous run of its own
latency; ``meets_floors`` holds eta 4 to ``COMPUTE_FLOORS`` (latency off: at least 0.95x the
synchronous run; latency on: at least 0.8 of the ceiling), on the training steps' wall time.
Every run also reports ``steady_trajectories_per_s`` (the steps after the first) and
``end_to_end_trajectories_per_s`` (the trained samples over the whole process, start-up included),
with the summary's ratios of both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["main", "overrides", "summarize_run", "summarize", "run_order", "reward_by_version", "last_complete_version",
           "apply_workload", "configurations", "FLOORS", "COMPUTE_FLOORS", "WORKLOADS"]

# issue 36: the least speed-up over the synchronous trajectories/s, per max_staleness
FLOORS = {1: 1.5, 2: 1.5, 4: 2.5}
# issue 49, --workload compute: eta 4's least trajectories/s over the synchronous latency-off run's
# (the compute ceiling), with the latency off and on
COMPUTE_FLOORS = {"off": 0.95, "on": 0.80}
# each workload's defaults of the options left unset on the command line
WORKLOADS: dict[str, dict[str, Any]] = {
    "calculator": {"etas": "1,2,4", "partial": "off,on", "seeds": "0", "steps": 6, "latency": "on"},
    "compute": {"etas": "1,4", "partial": "on", "seeds": "0,1", "steps": 8, "latency": "on,off"},
}


def overrides(*, eta: int, partial: bool, seed: int, args: argparse.Namespace, latency: bool = True) -> list[str]:
    """The ``agentrl train`` overrides of one configuration (``latency``: the calculator's on, else 0)."""
    calc = "agent.tool_config.calculator"
    median = args.latency_median_s if latency else 0.0
    learning = getattr(args, "workload", "calculator") == "calculator"  # the compute preset measures speed only
    out = [
        f"trainer.total_steps={args.steps}", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.export_hf=false",
        f"trainer.final_validation={str(learning).lower()}", "trainer.val_before_train=false",
        f"trainer.save_rollouts={str(learning).lower()}", "logging.progress=false",
        f"data.train_batch_size={args.batch_size}", f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.batch_size}",
        f"actor.ppo_micro_batch_size_per_gpu={math.gcd(8, args.batch_size * args.n)}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"data.max_response_length={args.max_response_length}",
        f"agent.max_assistant_turns={args.max_turns}", "sft.enable=false",
        f"+{calc}.latency_median_s={median}", f"+{calc}.latency_p99_s={args.latency_p99_s}",
        f"+{calc}.latency_seed={seed}", f"trainer.seed={seed}", f"rollout.max_staleness={eta}",
    ]
    if not learning:  # the word problems with turn credit (the module docstring)
        out += ["data=word_steps", "algorithm.grpo_turn_credit=true"]
    if getattr(args, "warm_start", None):
        out.append(f"model.path={args.warm_start}")
    if getattr(args, "val_n", 0):  # the final validation sampled: n answers a problem at val_temperature
        out += [f"data.task_val_size={args.val_size}", f"rollout.val_n={args.val_n}",
                f"rollout.val_temperature={args.val_temperature}"]
    if eta > 0:
        out += [f"rollout.partial={str(partial).lower()}", "actor.rollout_correction.level=token",
                f"actor.rollout_correction.method={getattr(args, 'correction', 'tis')}",
                f"rollout.stale_groups={getattr(args, 'stale_groups', 'drop')}"]
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
        # the steps after the first (whose wait for the first groups is part of start-up)
        "steady_trajectories_per_s": (samples_per_step * (len(rows) - 1) / (wall - rows[0]["timing/step_s"])
                                      if len(rows) > 1 else None),
        "response_length": statistics.fmean(r.get("response_length/mean", 0.0) for r in rows),
        "tool_calls": statistics.fmean(r.get("tool_calls/mean", 0.0) for r in rows),
    }


def reward_by_version(samples: Iterable[tuple[int | None, float]], *, complete_up_to: int) -> dict[int, float]:
    """The mean reward of ``(version, reward)`` samples by the policy version that sampled them,
    for the versions ``0 .. complete_up_to`` (later ones still had samples in flight at the end:
    those kept would be the quickest episodes)."""
    by: dict[int, list[float]] = {}
    for version, reward in samples:
        if version is not None and version <= complete_up_to:
            by.setdefault(version, []).append(reward)
    return {v: statistics.fmean(by[v]) for v in sorted(by)}


def last_complete_version(steps: int, eta: int) -> int:
    """The last policy version all of whose samples a run of ``steps`` steps trained or dropped:
    the last step trains version ``steps - 1 - eta`` at the oldest; a group of that version still
    in flight then would be dropped at the step after, which does not come (one version less)."""
    return steps - 1 if eta == 0 else steps - 2 - eta


def _stored_rewards(run_dir: Path) -> Iterable[tuple[int | None, float]]:
    from agentrl.data.rollout_store import RolloutStore

    for t in RolloutStore(run_dir / "rollouts").iter_trajectories(split="train"):
        yield t.oldest_version, t.reward


def _same_versions(group: list[dict[str, Any]], sync: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reward per sample of the policies of the versions every run of ``group`` and of
    ``sync`` has, per run the mean over those versions; means and sds over the runs."""
    if not all(r.get("reward_by_version") for r in group + sync):
        return None
    versions = sorted(set.intersection(*(set(map(int, r["reward_by_version"])) for r in group + sync)))
    if not versions:
        return None

    def per_run(r: dict[str, Any]) -> float:
        by = {int(v): x for v, x in r["reward_by_version"].items()}
        return statistics.fmean(by[v] for v in versions)

    mine, theirs = [per_run(r) for r in group], [per_run(r) for r in sync]
    sync_std = statistics.stdev(theirs) if len(theirs) > 1 else 0.0
    mean, sync_mean = statistics.fmean(mine), statistics.fmean(theirs)
    return {"versions": [versions[0], versions[-1]], "mean": mean, "std": statistics.stdev(mine) if len(mine) > 1 else 0.0,
            "sync_mean": sync_mean, "sync_std": sync_std, "within_sync_sd": abs(mean - sync_mean) <= sync_std}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: means over seeds, speed-up over the synchronous configuration, and
    whether an asynchronous one meets its floor (``FLOORS``) with its reward per sample within
    one standard deviation (the synchronous runs' over seeds) of the synchronous mean."""
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
        for key in ("steady_trajectories_per_s", "end_to_end_trajectories_per_s", "cpu_s_per_trajectory"):
            values = [g[key] for g in group if g.get(key) is not None]
            if values:
                out[name][key] = statistics.fmean(values)
        heldout = [g["heldout_success_after"] for g in group if g.get("heldout_success_after") is not None]
        out[name]["heldout_success_after"] = statistics.fmean(heldout) if heldout else None
        out[name]["heldout_std"] = statistics.stdev(heldout) if len(heldout) > 1 else 0.0
    if any(run.get("latency") == "off" for run in runs):
        return _with_ceiling(out, runs)
    sync = out.get("sync")
    etas = {run["config"]: run["eta"] for run in runs}
    for name, s in out.items():
        s["speedup"] = s["trajectories_per_s"] / sync["trajectories_per_s"] if sync else None
        if sync and etas[name] > 0:
            s["floor"] = FLOORS[max(k for k in FLOORS if k <= etas[name])]
            s["reward_within_sync_sd"] = abs(s["reward_per_sample"] - sync["reward_per_sample"]) <= sync["reward_std"]
            s["meets_floors"] = s["speedup"] >= s["floor"] and s["reward_within_sync_sd"]
            # the policy's own reward after as many samples (no lag), where the runs validated
            if s["heldout_success_after"] is not None and sync["heldout_success_after"] is not None:
                s["heldout_within_sync_sd"] = (
                    sync["heldout_success_after"] - s["heldout_success_after"] <= max(sync["heldout_std"], 1e-9))
            # the policies' own reward per sample at the versions both have (no lag either)
            s["reward_same_versions"] = _same_versions(by[name], by["sync"])
    return out


def _with_ceiling(out: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of runs with the latency on and off (``--latency on,off``): each configuration's
    speed-ups over the synchronous run of its latency (``sync`` or ``sync_nolat``), on the steps'
    wall time, the steps after the first and the whole process; ``x_ceiling`` over the synchronous
    latency-off run's; eta 4 held to ``COMPUTE_FLOORS``."""
    meta = {run["config"]: (run["eta"], run.get("latency", "on")) for run in runs}
    ceiling = out.get("sync_nolat")
    for name, s in out.items():
        eta, latency = meta[name]
        base = out.get("sync" if latency == "on" else "sync_nolat")
        for prefix in ("", "steady_", "end_to_end_"):  # the steps; the steps after the first; the whole process
            key = prefix + "trajectories_per_s"
            if base and s.get(key) is not None and base.get(key):
                s[prefix + "speedup"] = s[key] / base[key]
            if ceiling and s.get(key) is not None and ceiling.get(key):
                s[prefix + "x_ceiling"] = s[key] / ceiling[key]
        if base and s.get("cpu_s_per_trajectory") and base.get("cpu_s_per_trajectory"):  # the CPU a trajectory costs, x sync's
            s["cpu_ratio"] = s["cpu_s_per_trajectory"] / base["cpu_s_per_trajectory"]
        s["latency"] = latency
        if eta == 4 and ceiling:
            s["floor"] = COMPUTE_FLOORS[latency]
            s["meets_floors"] = s["x_ceiling"] >= s["floor"]
    return out


def apply_workload(args: argparse.Namespace) -> argparse.Namespace:
    """The workload's defaults (``WORKLOADS``) of the options left unset."""
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def configurations(etas: str, partial: str, latency: str) -> list[tuple[str, int, bool, str]]:
    """(name, eta, partial, latency) of every configuration: the synchronous one, then each eta with
    each partial setting, all of it for each latency setting (``_nolat``: the latency off)."""
    if not latency or set(latency.split(",")) - {"on", "off"}:
        raise SystemExit(f"--latency must be on, off or on,off, got {latency!r}")
    out = []
    for lat in latency.split(","):
        suffix = "" if lat == "on" else "_nolat"
        out += [("sync" + suffix, 0, False, lat)] + [
            (f"eta{eta}" + ("_partial" if p == "on" else "") + suffix, eta, p == "on", lat)
            for eta in (int(e) for e in etas.split(",") if e) for p in partial.split(",") if p]
    return out


def run_order(configs: list[Any], seeds: list[int]) -> list[tuple[int, Any]]:
    """(seed, configuration) in running order: the configurations as listed for the first seed,
    reversed for the second, and so on."""
    return [(seed, c) for i, seed in enumerate(seeds) for c in (configs if i % 2 == 0 else configs[::-1])]


# the second CPU job of --beside-cpu-job
BESIDE = {
    "busy": "while True: pass",
    "torch": "import torch\nx = torch.randn(512, 512)\nwhile True: x = torch.tanh(x @ x)",
}


def _cpu_s() -> float:
    """CPU seconds of this process's finished children (an ``agentrl train`` with its engine process)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _train(args: argparse.Namespace, name: str, extra: list[str], root: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One ``agentrl train``: its training steps' metrics rows and its summary.json."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    if args.threads:  # torch's intra-op threads: spin-waiting teams collapse on a shared machine
        env["OMP_NUM_THREADS"] = str(args.threads)
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *extra, f"trainer.runs_root={root}",
                           f"trainer.run_name={name}"], capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"agentrl train ({name}) failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r], json.loads((root / name / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench async", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="calculator",
                        help="calculator: the quickstart's arithmetic; compute: the word problems, longer episodes "
                             "(the module docstring); sets the defaults of the four options below and --latency")
    parser.add_argument("--etas", default=None, help="max_staleness values to run beside the synchronous trainer")
    parser.add_argument("--partial", default=None, help="partial rollouts for each eta: off, on or off,on")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (the issue's measurement uses 0,1,2)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--latency", default=None, help="the calculator's latency in every configuration: on, off or on,off")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-response-length", type=int, default=512)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--latency-median-s", type=float, default=0.3)
    parser.add_argument("--latency-p99-s", type=float, default=6.2)
    parser.add_argument("--sft", action="store_true",
                        help="start every run from the quickstart's SFT warm start, built once (off: the skilled base)")
    parser.add_argument("--warm-start", default=None, help="with --sft: this warm-start policy directory instead of building one")
    parser.add_argument("--beside-cpu-job", nargs="?", const="busy", choices=["busy", "torch"], default=None,
                        help="a second CPU job shares the cores with every run: a Python busy loop (busy, the default) "
                             "or a torch matrix-product loop at torch's default thread count (torch)")
    parser.add_argument("--correction", choices=["tis", "decoupled"], default="tis",
                        help="actor.rollout_correction.method of the asynchronous runs")
    parser.add_argument("--stale-groups", choices=["drop", "wait"], default="drop",
                        help="rollout.stale_groups of the asynchronous runs: drop a group that finished too old, or "
                             "make the trainer wait for a group before it can become stale")
    parser.add_argument("--val-n", type=int, default=0,
                        help="sample the final validation: this many answers a problem at --val-temperature "
                             "(0: one greedy answer, the config's default)")
    parser.add_argument("--val-size", type=int, default=32, help="with --val-n: data.task_val_size")
    parser.add_argument("--val-temperature", type=float, default=1.0, help="with --val-n: rollout.val_temperature")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run (0: inherit)")
    args = apply_workload(parser.parse_args(argv))
    configs = configurations(args.etas, args.partial, args.latency)
    seeds = [int(s) for s in args.seeds.split(",")]
    beside_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default thread count
    busy = subprocess.Popen([sys.executable, "-c", BESIDE[args.beside_cpu_job]], env=beside_env) if args.beside_cpu_job else None
    runs = []
    load_before = os.getloadavg()
    try:
        from agentrl_benchmarks._scratch import scratch_dir

        with scratch_dir("agentrl-bench-async") as tmp:
            if args.sft and not args.warm_start:
                _train(args, "warm", ["trainer.total_steps=0", "trainer.save_freq=0", "trainer.test_freq=0",
                                      "trainer.val_before_train=false", "trainer.export_hf=false",
                                      "trainer.save_rollouts=false", "logging.progress=false"], Path(tmp))
                args.warm_start = str(Path(tmp) / "warm" / "sft_policy")
            for seed, (name, eta, partial, latency) in run_order(configs, seeds):
                start, load, cpu = time.perf_counter(), os.getloadavg()[0], _cpu_s()
                rows, summary = _train(args, f"{name}-s{seed}", overrides(eta=eta, partial=partial, seed=seed, args=args,
                                                                          latency=latency == "on"), Path(tmp))
                wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
                run = summarize_run(rows, eta=eta, samples_per_step=args.batch_size * args.n)
                run["heldout_success_after"] = summary.get("heldout_success_after")  # the final validation
                if args.workload == "calculator":  # the compute preset keeps no rollout store
                    run["reward_by_version"] = reward_by_version(_stored_rewards(Path(tmp) / f"{name}-s{seed}"),
                                                                 complete_up_to=last_complete_version(run["steps"], eta))
                runs.append({"config": name, "eta": eta, "partial": partial, "latency": latency, "seed": seed,
                             "process_wall_s": wall, "end_to_end_trajectories_per_s": args.batch_size * args.n * run["steps"] / wall,
                             "load_average_before": load, "load_average_after": os.getloadavg()[0],
                             # the CPU the run took (trainer and engine processes, start-up included): what a
                             # machine whose other jobs leave it one core's share of time charges it for
                             "cpu_s": cpu, "cpu_s_per_trajectory": cpu / (args.batch_size * args.n * run["steps"]), **run})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # each run as it ends
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings["cpu_count"] = os.cpu_count()
    settings["load_average_before"], settings["load_average_after"] = load_before[0], os.getloadavg()[0]
    print(json.dumps({"runs": runs, "summary": summarize(runs), "settings": settings}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

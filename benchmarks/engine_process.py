"""The built-in engine in its own process (``agentrl.engines.process.EngineProcess``), measured.

Three parts, one JSON object:

* ``sync``: a weight update of the engine process, a state dict through the shared file mapping
  (``update_weights(state_dict)``: the parent's copy into the mapping, the child's copy into its
  model) against a checkpoint file (``safetensors.save_file`` then ``update_weights(path=...)``:
  write, read, copy), for the tiny model's shape and Qwen2.5-0.5B's (random weights, fp32); the
  median of ``--repeats`` updates after a first one (which makes the mapping).
* ``loop``: how far a tool's ``await asyncio.sleep(0.2)`` overruns on the event loop that also
  waits on four requests of 1,000-token prompts, with the engine stepping on that loop (the
  synchronous trainer's placement), on a thread of the same process (the asynchronous trainer's
  placement before the engine process) and in its own process; idle, and beside a CPU job.
* ``contention``: the engine process decoding (4 requests x 64 tokens) on as many threads as the
  machine has cores, alone and beside a CPU job that runs small matrix products on as many
  threads, with libgomp's default wait policy and with ``OMP_WAIT_POLICY=PASSIVE`` (the engine
  process's setting); runs alternate.
* ``train`` (not in the default parts): asynchronous ``agentrl train`` steps on the tiny model
  beside a CPU job, the engine on a thread of the trainer's process against its own process, at
  the default thread counts or (``--train-threads cores``) every process on all cores; runs alternate.

    python -m agentrl_benchmarks.engine_process [--parts sync,loop,contention,train] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agentrl_benchmarks._scratch import scratch_dir

__all__ = ["main"]

BURNER = ("import torch, os; torch.set_num_threads(int(os.environ['THREADS'])); a = torch.randn(192, 192)\n"
          "while True:\n    for _ in range(200): a = torch.tanh(a @ a)")


def _burner(threads: int) -> subprocess.Popen:
    env = dict(os.environ, THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    return subprocess.Popen([sys.executable, "-c", BURNER], env=env)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()


def _slow_model(path: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                         initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    Qwen2ForCausalLM(config).eval().save_pretrained(path)
    return path


async def _sync(shape: str, repeats: int, root: Path, threads: int) -> dict:
    from safetensors.torch import save_file

    from agentrl.engines.process import EngineProcess
    from agentrl_benchmarks.export import _model

    model = _model(shape, __import__("torch").float32)
    source = root / f"{shape}-source"
    model.save_pretrained(source)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = EngineProcess(source, threads=threads, max_batch_size=2, max_seq_len=256, start_timeout_s=600)
    try:
        started = time.perf_counter()
        await engine.update_weights(state, version=1)
        first = time.perf_counter() - started
        mapped, filed = [], []
        directory = root / f"{shape}-file"
        directory.mkdir()
        for i in range(repeats):
            started = time.perf_counter()
            await engine.update_weights(state, version=2 + 2 * i)
            mapped.append(time.perf_counter() - started)
            started = time.perf_counter()
            save_file(state, str(directory / "model.safetensors"))
            await engine.update_weights(path=str(directory), version=3 + 2 * i)
            filed.append(time.perf_counter() - started)
    finally:
        engine.close()
    return {"bytes": nbytes, "map_first_s": round(first, 4), "map_s": round(statistics.median(mapped), 4),
            "file_s": round(statistics.median(filed), 4), "file_over_map": round(statistics.median(filed) / statistics.median(mapped), 2)}


async def _overruns(engine, sleeps: int) -> list[float]:
    from agentrl.engines.base import GenerateRequest, SamplingParams

    prompts = [[(i * 7 + j) % 256 for j in range(1000)] for i in range(4)]
    calls = [asyncio.create_task(engine.generate(GenerateRequest(p, SamplingParams(max_new_tokens=400, temperature=1.0, seed=i))))
             for i, p in enumerate(prompts)]
    await asyncio.sleep(0)
    out = []
    for _ in range(sleeps):
        started = time.perf_counter()
        await asyncio.sleep(0.2)
        out.append(time.perf_counter() - started - 0.2)
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    return out


async def _loop(model: Path, sleeps: int, threads: int) -> dict:
    from agentrl.engines.builtin import BuiltinEngine
    from agentrl.engines.process import EngineProcess

    results: dict[str, dict] = {}
    for load in ("idle", "beside a CPU job"):
        for placement in ("event_loop", "thread", "process"):
            burner = _burner(threads) if load != "idle" else None
            try:
                if placement == "process":
                    engine = EngineProcess(model, threads=threads, max_batch_size=8, seed=0, start_timeout_s=600)
                else:
                    engine = BuiltinEngine(model, max_batch_size=8, seed=0, steps_on=placement)
                try:
                    over = await _overruns(engine, sleeps)
                finally:
                    engine.close()
            finally:
                _stop(burner)
            results[f"{placement}, {load}"] = {"max_s": round(max(over), 4), "median_s": round(statistics.median(over), 4)}
    return results


async def _decode(engine) -> float:
    from agentrl.engines.base import GenerateRequest, SamplingParams

    started = time.perf_counter()
    await asyncio.gather(*(engine.generate(GenerateRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=64, temperature=1.0, seed=i)))
                           for i in range(4)))
    return time.perf_counter() - started


async def _contention(model: Path, repeats: int) -> dict:
    from agentrl.engines.process import EngineProcess

    cores = os.cpu_count() or 2
    engines = {policy: EngineProcess(model, threads=cores, max_batch_size=8, seed=0, omp_wait_policy=policy, start_timeout_s=600)
               for policy in ("", "PASSIVE")}
    times: dict[str, list[float]] = {}
    try:
        for engine in engines.values():
            await _decode(engine)  # warm
        for _ in range(repeats):
            for load in ("alone", "beside a CPU job"):
                for policy, engine in engines.items():
                    burner = _burner(cores) if load != "alone" else None
                    try:
                        if burner is not None:
                            time.sleep(1.0)  # the job's threads are running
                        times.setdefault(f"{policy or 'default'}, {load}", []).append(await _decode(engine))
                    finally:
                        _stop(burner)
    finally:
        for engine in engines.values():
            engine.close()
    return {"threads": cores, **{k: round(statistics.median(v), 3) for k, v in times.items()}}


TRAIN = ["trainer.total_steps=6", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size_per_gpu=4", "data.task_train_size=64", "data.task_val_size=8", "rollout.max_new_tokens=32",
         "data.max_response_length=96", "sft.num_demos=32", "sft.epochs=1", "logging.progress=false", "model.tiny.skills=none",
         "trainer.save_freq=0", "trainer.test_freq=0", "trainer.export_hf=false", "trainer.val_before_train=false",
         "trainer.save_rollouts=false", "rollout.max_staleness=1", "actor.rollout_correction.level=token"]


def _train(root: Path, repeats: int, all_cores: bool) -> dict:
    """Asynchronous ``agentrl train`` steps (tiny model, eta 1) beside a CPU job on the machine's
    core count of threads, the engine on a thread of the trainer's process (``engine.process=false``)
    against its own process; ``all_cores``: the trainer and the engine at the core count of threads
    too (``OMP_NUM_THREADS``), else at their defaults (the trainer alone on all cores with the engine
    on its thread; split between the two with the engine process). The median of steps 2 to 6."""
    cores = os.cpu_count() or 2
    env = dict(os.environ, OMP_NUM_THREADS=str(cores)) if all_cores else dict(os.environ)
    if not all_cores:
        env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)
    steps: dict[str, list[float]] = {}
    for i in range(repeats):
        for placement in ("false", "true"):
            run = root / f"train-{placement}-{i}"
            burner = _burner(cores)
            try:
                done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *TRAIN, f"engine.process={placement}",
                                       f"trainer.runs_root={run}", "trainer.run_name=r"], env=env, capture_output=True, text=True,
                                      timeout=1800)
            finally:
                _stop(burner)
            if done.returncode != 0:
                raise RuntimeError(f"agentrl train failed: {done.stderr[-2000:]}")
            rows = [json.loads(line) for line in (run / "r" / "metrics.jsonl").read_text().splitlines()]
            step_s = [r["timing/step_s"] for r in rows if "timing/step_s" in r and r["step"] >= 2]
            steps.setdefault("engine thread" if placement == "false" else "engine process", []).append(statistics.median(step_s))
    return {"threads": "all cores" if all_cores else "defaults", **{k: [round(v, 3) for v in vals] for k, vals in steps.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl_benchmarks.engine_process", description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="sync,loop,contention")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleeps", type=int, default=8, help="tool sleeps measured per placement (loop)")
    parser.add_argument("--shapes", default="tiny,0.5b", help="model shapes of the sync part")
    parser.add_argument("--threads", type=int, default=1, help="engine threads of the sync and loop parts")
    parser.add_argument("--train-threads", choices=("defaults", "cores"), default="defaults",
                        help="train part: the trainer's and engine's default threads, or every process on all cores")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    out: dict = {"cores": os.cpu_count()}
    with scratch_dir("engine-process") as root:
        if "sync" in parts:
            out["sync"] = {shape: asyncio.run(_sync(shape, args.repeats, root, args.threads)) for shape in args.shapes.split(",")}
        if "loop" in parts or "contention" in parts:
            model = _slow_model(root / "slow")
            if "loop" in parts:
                out["loop"] = asyncio.run(_loop(model, args.sleeps, args.threads))
            if "contention" in parts:
                out["contention"] = asyncio.run(_contention(model, args.repeats))
        if "train" in parts:
            out["train"] = _train(root, args.repeats, all_cores=args.train_threads == "cores")
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

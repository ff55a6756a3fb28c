"""``agentrl bench lora``: peak memory and step time of LoRA against full fine-tuning, side by side.

Both sides run the real ``ActorWorker`` (one rank, fp32 on CPU, unwrapped as ``dist.shard_model``
does for one fp32 rank) on the same tiny model (``--model-size``, default the 18M config), the same
seeded batch of ``--batch`` trajectories (``--prompt-len`` + ``--response-len`` tokens) and the
same PPO update: an old-logprob pass, then one optimizer step. Only ``actor.lora.rank`` differs
(0 for full fine-tuning).

Each side runs ``--repeats`` times, each in a fresh process (so peak memory is that run's own),
the sides alternating which goes first (full, lora, lora, full, ...) so the machine's drift hits
both alike. Per run: ``step_s`` (median over the ``--steps`` steps after one warm-up step),
``peak_rss_mib`` (the process's peak resident memory: model, gradients, optimizer state,
activations, interpreter), ``optimizer_state_mib`` (AdamW's moments, exact) and
``trainable_params``. Prints one JSON object: per side the medians over repeats (with ``_all``),
the ratios full/lora, and the settings.

    agentrl bench lora --json [--model-size 18m] [--rank 8] [--steps 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from agentrl_benchmarks._scratch import scratch_dir

__all__ = ["main"]


def _one_run(args: argparse.Namespace, rank: int, cache: str) -> dict[str, Any]:
    """In the child process: build the actor, time the steps, report peak memory."""
    import resource
    import time

    import torch

    from agentrl.config.schema import ActorConfig, LoraConfig, OptimConfig
    from agentrl.tiny import tiny_model_dir
    from agentrl.trainer.batch import collate_sequences
    from agentrl.trainer.dist import free_port
    from agentrl.trainer.rank import mini_batch_denominator
    from agentrl.trainer.workers import ActorWorker

    model_dir = tiny_model_dir(args.size, seed=0, cache_root=cache)
    config = ActorConfig(optim=OptimConfig(lr=1e-4), ppo_micro_batch_size_per_gpu=args.batch,
                         ppo_mini_batch_size=args.batch, lora=LoraConfig(rank=rank, alpha=2.0 * max(rank, 1)))
    actor = ActorWorker(model_path=str(model_dir), config=config, total_steps=args.steps + 1, rank=0, world_size=1,
                        master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    responses = [torch.randint(3, 200, (args.response_len,), generator=g).tolist() for _ in range(args.batch)]
    batch = collate_sequences(prompts, responses, [[1] * args.response_len] * args.batch, pad_token_id=0)
    batch = batch.replace(advantages=torch.linspace(-1, 1, args.batch).unsqueeze(1) * batch.response_mask)
    denominator = mini_batch_denominator(batch.response_mask, "token-mean")
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        old, _ = actor.compute_logprobs(batch, args.batch)
        actor.update([batch.replace(old_logprobs=old)], [denominator], use_kl_loss=False)
        times.append(time.perf_counter() - start)
    moments = sum(t.numel() * t.element_size() for s in actor.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    return {
        "step_s": statistics.median(times[1:]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "optimizer_state_mib": moments / 2**20,
        "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench lora", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON (the only output form)")
    parser.add_argument("--model-size", dest="size", default="18m", help="tiny model size (agentrl/tiny.py)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 * rank, attention projections)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating order")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per step")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # internal: one run at this rank
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_one_run(args, args.child, args.cache)))
        return 0

    sides = {"full": 0, "lora": args.rank}
    order = [name for i in range(args.repeats) for name in (("full", "lora") if i % 2 == 0 else ("lora", "full"))]
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    with scratch_dir("bench-lora") as scratch:
        passed = [f"--model-size={args.size}", f"--steps={args.steps}", f"--batch={args.batch}",
                  f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}", f"--cache={scratch}"]
        for name in order:
            child = subprocess.run(
                [sys.executable, "-m", "agentrl_benchmarks.lora", f"--child={sides[name]}", *passed],
                capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if child.returncode != 0:
                raise RuntimeError(f"bench lora: the {name} run failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
            runs[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
    result: dict[str, Any] = {"order": order, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "cache", "json")}}
    for name, side in runs.items():
        for key in side[0]:
            values = [r[key] for r in side]
            result[f"{name}_{key}"] = statistics.median(values)
            result[f"{name}_{key}_all"] = values
    result["step_ratio_full_over_lora"] = result["full_step_s"] / result["lora_step_s"]
    result["peak_rss_ratio_full_over_lora"] = result["full_peak_rss_mib"] / result["lora_peak_rss_mib"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

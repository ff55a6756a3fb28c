"""GPU figures for issues #18 (item 6) and #40, as far as they can be measured without Ray or SGLang.

On a Qwen2-shaped model with random weights (``--shape 0.5b``: Qwen2.5-0.5B's shape), this measures:

a. the built-in engine (``BuiltinEngine``): tokens/s at several concurrencies, the decode step,
   and the time to first token read off its step log; ``model.generate`` on a static batch of
   the same shape as a reference (parts ``engine``, ``generate``);
b. one GRPO-shaped actor update through ``ActorWorker.call('update_on_policy')``, no Ray: the one
   rank as the trainer runs it (unwrapped, bf16 autocast over fp32 parameters on CUDA; part
   ``actor_update``), the same rank wrapped in FSDP2 by hand (part ``actor_update_fsdp2``), and
   the packed path on an unwrapped bf16 model with fused AdamW (part ``packed_update``);
c. weight sync into the engine: in memory (``ActorWorker.sync_weights``'s path, and a direct
   GPU-to-GPU ``update_weights``) and through disk (``export_hf`` + ``update_weights(path=)``;
   part ``weight_sync``); the disk writer ``hf_export.write_hf_checkpoint`` against
   ``safetensors.save_file`` of the same tensors (part ``export``);
d. whether NCCL between two processes on one GPU works (part ``nccl_two_processes``);
e. ``agentrl train`` in one child process (one-rank groups in-process, no Ray), GRPO on the
   multi-turn ``arith_retry`` task (tool_agent loop + retry interaction) with the built-in engine,
   actor + reference: step time by phase, rollout tokens/s, weight sync time, peak GPU memory;
   with ``engine.weight_sync=memory`` (part ``train``) and ``disk`` (part ``train_disk``). Its
   model has the shape above, random weights, the shipped tiny model's tokenizer, and the
   end-of-turn row of its embedding scaled (``EOS_ROW_SCALE``) so that turns end before the
   length limit and the episodes run several turns.

Each part runs in its own try/except: a failure is recorded with its error text and the other
parts still run. Prints JSON and writes ``$OUT/gpu_check.json`` after every part when OUT is set
(and the train runs' logs as ``$OUT/train-*.log``).

    python3 scripts/gpu_check.py --device cuda --shape 0.5b
    python scripts/gpu_check.py --device cpu --shape tiny      # a quick check of the script itself

The packages it needs beyond the GPU machines' image: scripts/gpu_wheels.sh (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, max_position_embeddings=2048, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])


def run_part(results: dict, name: str, fn, *args):
    """Run one part; its figures (or its error) go under ``results[name]``."""
    started = time.perf_counter()
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    try:
        out = fn(*args)
        results[name] = {**(out or {}), "wall_s": round(time.perf_counter() - started, 3)}
    except BaseException as exc:  # noqa: BLE001 - a part's failure is a result
        results[name] = {"error": error_text(exc), "wall_s": round(time.perf_counter() - started, 3)}
        out = None
    print(f"[gpu_check] {name}: {json.dumps(results[name])[:2000]}", file=sys.stderr, flush=True)
    return out


def make_config(shape: str):
    from transformers import Qwen2Config

    config = Qwen2Config(**SHAPES[shape], use_sliding_window=False)
    config.eos_token_id = None
    config.pad_token_id = 0
    return config


def new_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # a config of its own: the engine sets its attention implementation on it
        model = Qwen2ForCausalLM(copy.deepcopy(config))
    return model.to(dtype=dtype).eval()


def save_model_dir(model: torch.nn.Module, directory: Path) -> None:
    """A transformers checkpoint with a minimal tokenizer (``ActorWorker.export_hf`` reloads one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "<pad>": 1}, unk_token="<unk>")),
        unk_token="<unk>", pad_token="<pad>",
    )
    tokenizer.save_pretrained(directory)


def dir_bytes(directory: Path, pattern: str = "*.safetensors") -> int:
    return sum(f.stat().st_size for f in Path(directory).glob(pattern))


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------------------------------- a


def engine_throughput(engine, args, device) -> dict:
    from agentrl.engines.base import GenerateRequest, SamplingParams

    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(1)

    async def batch(concurrency: int, new_tokens: int) -> tuple[float, list, dict]:
        prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(concurrency)]
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)  # no stop ids: runs to the length
        requests = [GenerateRequest(p, sampling, rid=f"c{concurrency}-{i}-{time.monotonic_ns()}") for i, p in enumerate(prompts)]
        engine.step_log.clear()
        started = now(device)
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        wall = now(device) - started
        steps = list(engine.step_log)
        ttft = {}
        for record in steps:
            for rid in record.prefill_rids:
                ttft.setdefault(rid, record.ended - started)
        return wall, results, {"ttft": [ttft[r.rid] for r in requests if r.rid in ttft], "steps": steps}

    async def main() -> dict:
        await batch(min(4, max(args.concurrency)), 8)  # warm-up: CUDA context, cuBLAS handles, allocator
        for c in args.concurrency:  # and each concurrency's decode graph (captured at its first step)
            await batch(c, 4)
        figures = {}
        for c in args.concurrency:
            wall, results, extra = await batch(c, args.new_tokens)
            generated = sum(len(r.output_ids) for r in results)
            steps = extra["steps"]
            decode_only = [s.ended - s.started for s in steps if not s.prefill_rids]
            prefill_steps = [s for s in steps if s.prefill_rids]
            ttft = extra["ttft"]
            figures[str(c)] = {
                "requests": c, "generated_tokens": generated, "wall_s": round(wall, 4),
                "tokens_per_s": round(generated / wall, 1),
                "ttft_s_median": round(statistics.median(ttft), 4) if ttft else None,
                "ttft_s_max": round(max(ttft), 4) if ttft else None,
                "engine_steps": len(steps), "prefill_steps": len(prefill_steps),
                "decode_step_ms_median": round(1e3 * statistics.median(decode_only), 3) if decode_only else None,
                "finish_reasons": sorted({r.finish_reason.value for r in results}),
            }
            print(f"[gpu_check]   engine c={c}: {figures[str(c)]}", file=sys.stderr, flush=True)
        return figures

    out = asyncio.run(main())
    return {"ttft_source": "BuiltinEngine.step_log: end of the step that prefilled the request, from submission "
                           "(the engine reports no TTFT itself)", "by_concurrency": out}


def part_engine(config, args, device, dtype, state, *, graphs: bool | None = None) -> dict:
    """``graphs``: the engine's ``decode_graphs`` (None: its default, on for CUDA)."""
    from agentrl.engines.builtin import BuiltinEngine

    model = new_model(config, device, dtype, seed=0)
    t0 = time.perf_counter()
    engine = BuiltinEngine(model, device=str(device), dtype=dtype, max_batch_size=max(args.concurrency),
                           max_seq_len=args.prompt_len + args.new_tokens + 64, seed=0, decode_graphs=graphs)
    build_s = time.perf_counter() - t0
    if graphs is None:
        state["engine"] = engine
    try:
        figures = engine_throughput(engine, args, device)
        static = engine._scheduler.static_decode
        return {"engine_build_s": round(build_s, 3), "forward": type(engine._scheduler.forward).__name__,
                "decode_graphs_arg": graphs, "static_decode": static is not None,
                "static_decode_steps": static.steps if static else None,
                "cuda_graph_replays": static.replays if static else None,
                "graphs_captured": sorted(static._captured) if static else None,
                "capture_error": static.capture_error if static else None,
                "max_batch_size": engine.max_batch_size, "max_prefill_tokens": engine.max_prefill_tokens,
                "kv_cache_bytes": engine.stats().kv_cache_bytes, **figures}
    finally:
        if graphs is not None:
            engine.close()


def part_engine_agreement(config, args, device, dtype) -> dict:
    """The same greedy requests through the engine with and without decode graphs, and each
    engine's logprobs against a full forward of the same weights (the trainer's side)."""
    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.builtin import BuiltinEngine

    g = torch.Generator().manual_seed(9)
    count, new_tokens = (4, 8) if args.shape == "tiny" else (16, 32)
    prompts = [torch.randint(2, config.vocab_size, (args.prompt_len // 2 + 3 * i,), generator=g).tolist() for i in range(count)]
    out: dict = {"requests": count, "new_tokens": new_tokens}
    results = {}
    for graphs in (True, False):
        model = new_model(config, device, dtype, seed=0)
        engine = BuiltinEngine(model, device=str(device), dtype=dtype, max_batch_size=count, seed=0, decode_graphs=graphs,
                               max_seq_len=args.prompt_len + new_tokens + 64)
        try:
            async def main():
                return await asyncio.gather(*(engine.generate(GenerateRequest(
                    p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), rid=f"a{i}")) for i, p in enumerate(prompts)))

            results[graphs] = asyncio.run(main())
            static = engine._scheduler.static_decode
            worst = 0.0
            with torch.no_grad():
                for p, r in zip(prompts, results[graphs]):
                    ids = torch.tensor([p + r.output_ids], device=device)
                    logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
                    full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids, device=device)[:, None])[:, 0]
                    worst = max(worst, float((full.cpu() - torch.tensor(r.logprobs)).abs().max()))
            out["graphs" if graphs else "no_graphs"] = {
                "static_decode_steps": static.steps if static else None, "cuda_graph_replays": static.replays if static else None,
                "capture_error": static.capture_error if static else None, "max_abs_logprob_diff_vs_full_forward": worst}
        finally:
            engine.close()
            del engine, model
    same = [a.output_ids == b.output_ids for a, b in zip(results[True], results[False])]
    out["same_tokens_fraction"] = sum(same) / len(same)
    diffs = [abs(x - y) for a, b in zip(results[True], results[False]) if a.output_ids == b.output_ids
             for x, y in zip(a.logprobs, b.logprobs)]
    out["max_abs_logprob_diff_graphs_vs_not"] = max(diffs) if diffs else None
    return out


def part_generate(config, args, device, dtype) -> dict:
    model = new_model(config, device, dtype, seed=0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(2)
    figures = {}

    def once(c: int, new_tokens: int) -> tuple[float, int]:
        ids = torch.randint(2, config.vocab_size, (c, args.prompt_len), generator=g).to(device)
        started = now(device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        wall = now(device) - started
        return wall, (out.shape[1] - args.prompt_len) * c

    once(min(4, max(args.concurrency)), 8)  # warm-up
    for c in args.concurrency:
        wall, generated = once(c, args.new_tokens)
        figures[str(c)] = {"requests": c, "generated_tokens": generated, "wall_s": round(wall, 4),
                           "tokens_per_s": round(generated / wall, 1)}
        print(f"[gpu_check]   generate c={c}: {figures[str(c)]}", file=sys.stderr, flush=True)
    import transformers

    return {"what": "model.generate, static batch, sampling, default cache", "attn_implementation":
            model.config._attn_implementation, "transformers": transformers.__version__, "by_concurrency": figures}


# ---------------------------------------------------------------------------------------- b


def grpo_batch(args, vocab: int):
    """``--rows`` rows in groups of ``--group`` sharing a prompt; full-length responses; random advantages."""
    from agentrl.trainer.batch import collate_sequences

    g = torch.Generator().manual_seed(3)
    prompts, responses = [], []
    for _ in range(args.rows // args.group):
        prompt = torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.group):
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (args.response_len,), generator=g).tolist())
    masks = [[1] * len(r) for r in responses]
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    advantages = torch.randn(len(prompts), 1, generator=g) * batch.response_mask
    return batch.replace(advantages=advantages)


def part_actor_update(args, device, state) -> dict:
    from agentrl.config.schema import ActorConfig, OptimConfig
    from agentrl.trainer import packed
    from agentrl.trainer.rank import mini_batch_denominator
    from agentrl.trainer.workers import ActorWorker

    config = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_micro_batch_size_per_gpu=args.micro_batch,
                         ppo_mini_batch_size=args.rows // args.group)
    t0 = time.perf_counter()
    worker = ActorWorker(model_path=str(state["model_dir"]), config=config, total_steps=1000, rank=0, world_size=1,
                         master_addr="127.0.0.1", master_port=0, device=str(device), seed=0)
    build_s = time.perf_counter() - t0
    state["worker"] = worker
    batch = grpo_batch(args, worker.model.config.vocab_size)
    denominator = mini_batch_denominator(batch.response_mask, "token-mean")
    times = []
    for _ in range(args.warmup + args.steps):
        started = now(device)
        # through `call`, as Ray calls it: a bf16 rank without FSDP2 computes under autocast there
        metrics, _, _ = worker.call("update_on_policy", f"{args.tmp or tempfile.gettempdir()}/stacks.txt", batch, denominator, use_kl_loss=False)
        times.append(now(device) - started)
    measured = times[args.warmup:]
    state["actor_update_median_s"] = statistics.median(measured)
    from torch.distributed.fsdp import FSDPModule

    micro = batch.select(slice(0, args.micro_batch)).to(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "what": "ActorWorker.call('update_on_policy') (one optimizer step, micro-batches accumulated), no Ray",
        "autocast": str(worker.autocast_dtype),
        "rows": len(batch), "prompt_len": args.prompt_len, "response_len": args.response_len, "group": args.group,
        "micro_batch": args.micro_batch, "tokens": int(batch.attention_mask.sum()),
        "fsdp2_wrapped": isinstance(worker.model, FSDPModule), "param_dtype_compute": str(worker.param_dtype),
        "master_param_dtype": str(next(worker.model.parameters()).dtype),
        "forward_path": "packed" if packed.packed_supported(worker.model, micro) else "prefix (shared prompts + length buckets)",
        "optimizer": type(worker.optimizer).__name__, "worker_build_s": round(build_s, 3),
        "step_s": [round(t, 4) for t in times], "step_s_median": round(statistics.median(measured), 4),
        "tokens_per_s": round(int(batch.attention_mask.sum()) / statistics.median(measured), 1),
        "pg_loss": metrics.get("actor/pg_loss"), "grad_norm": metrics.get("actor/grad_norm"),
        "cuda_max_memory_allocated_gb": round(peak / 1e9, 2) if peak else None,
    }


def part_actor_update_fsdp2(args, device, state) -> dict:
    """The same update with the one rank wrapped in FSDP2 (bf16 compute over fp32 parameters), as
    the trainer ran it before one rank was left unwrapped: ``fully_shard`` called directly, as
    ``dist.shard_model`` does for several ranks, and no autocast."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from agentrl.config.schema import ActorConfig, OptimConfig
    from agentrl.trainer import packed
    from agentrl.trainer.dist import _decoder_layers
    from agentrl.trainer.optim import build_optimizer
    from agentrl.trainer.rank import mini_batch_denominator
    from agentrl.trainer.workers import ActorWorker

    state.pop("worker_fsdp2", None)
    optim = OptimConfig(lr=1e-6)
    config = ActorConfig(optim=optim, ppo_micro_batch_size_per_gpu=args.micro_batch, ppo_mini_batch_size=args.rows // args.group)
    worker = ActorWorker(model_path=str(state["model_dir"]), config=config, total_steps=1000, rank=0, world_size=1,
                         master_addr="127.0.0.1", master_port=0, device=str(device), seed=0)
    policy = MixedPrecisionPolicy(param_dtype=worker.param_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(worker.model):
        fully_shard(layer, mesh=worker.mesh, mp_policy=policy)
    fully_shard(worker.model, mesh=worker.mesh, mp_policy=policy)
    worker.optimizer = build_optimizer(worker.model.parameters(), optim)
    worker.autocast_dtype = None  # FSDP2's mixed precision casts instead
    batch = grpo_batch(args, worker.model.config.vocab_size)
    denominator = mini_batch_denominator(batch.response_mask, "token-mean")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.warmup + args.steps):
        started = now(device)
        metrics, _, _ = worker.call("update_on_policy", f"{args.tmp or tempfile.gettempdir()}/stacks.txt", batch, denominator, use_kl_loss=False)
        times.append(now(device) - started)
    measured = times[args.warmup:]
    micro = batch.select(slice(0, args.micro_batch)).to(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out = {
        "what": "ActorWorker.call('update_on_policy') with the one rank wrapped in FSDP2 by hand (bf16 param_dtype, fp32 reduce), no autocast",
        "fsdp2_wrapped": isinstance(worker.model, FSDPModule), "param_dtype_compute": str(worker.param_dtype),
        "forward_path": "packed" if packed.packed_supported(worker.model, micro) else "prefix (shared prompts + length buckets)",
        "rows": len(batch), "micro_batch": args.micro_batch, "tokens": int(batch.attention_mask.sum()),
        "step_s": [round(t, 4) for t in times], "step_s_median": round(statistics.median(measured), 4),
        "tokens_per_s": round(int(batch.attention_mask.sum()) / statistics.median(measured), 1),
        "pg_loss": metrics.get("actor/pg_loss"), "grad_norm": metrics.get("actor/grad_norm"),
        "cuda_max_memory_allocated_gb_since_reset": round(peak / 1e9, 2) if peak else None,
    }
    unwrapped = state.get("actor_update_median_s")
    if unwrapped:
        out["fsdp2_over_unwrapped"] = round(out["step_s_median"] / unwrapped, 2)
    del worker
    return out


def part_packed_update(config, args, device, dtype, state) -> dict:
    from agentrl.trainer import packed
    from agentrl.trainer.prefix import response_logprobs

    model = new_model(config, device, dtype, seed=0).train()
    state["packed_model"] = model
    batch = grpo_batch(args, config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type in ("cuda", "cpu"))
    micros = [m.trim().to(device) for m in batch.split(args.micro_batch)]
    path = "packed" if packed.packed_supported(model, micros[0]) else "prefix"
    tokens = int(batch.response_mask.sum())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.warmup + args.steps):
        started = now(device)
        optimizer.zero_grad(set_to_none=True)
        for m in micros:
            logprobs, _ = response_logprobs(model, m)
            loss = -(logprobs * m.advantages * m.response_mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(now(device) - started)
    measured = times[args.warmup:]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "what": "prefix.response_logprobs on an unwrapped model (bf16 weights), fused AdamW, one optimizer step",
        "forward_path": path, "rows": len(batch), "micro_batch": args.micro_batch, "param_dtype": str(dtype),
        "step_s": [round(t, 4) for t in times], "step_s_median": round(statistics.median(measured), 4),
        "tokens_per_s": round(int(batch.attention_mask.sum()) / statistics.median(measured), 1),
        "cuda_max_memory_allocated_gb": round(peak / 1e9, 2) if peak else None,
    }


# ---------------------------------------------------------------------------------------- c


def part_weight_sync(config, args, device, dtype, state) -> dict:
    engine, worker = state.get("engine"), state.get("worker")
    if engine is None:
        raise RuntimeError("no engine (part engine failed)")
    out: dict = {}
    version = 100

    def timed(fn):
        started = now(device)
        value = fn()
        return value, now(device) - started

    # 1. ActorWorker.sync_weights's in-memory path: gather the full state (to CPU), copy into the engine.
    if worker is not None:
        worker.engine = engine
        worker.shares_model = False
        for _ in range(2):  # the first is a warm-up
            version += 1
            gathered, gather_s = timed(worker.policy_state)
            _, copy_s = timed(lambda: asyncio.run(engine.update_weights(state_dict=gathered, version=version)))
            version += 1
            _, total_s = timed(lambda: worker.sync_weights(version))
        size = state_bytes(gathered)
        out["actor_sync_weights_memory"] = {
            "what": "ActorWorker.sync_weights (weight_sync=memory, engine not sharing the module): "
                    "policy_state (FSDP2 full state, cpu_offload) + engine.update_weights(state_dict)",
            "bytes": size, "dtype": str(next(iter(gathered.values())).dtype), "device": str(next(iter(gathered.values())).device),
            "policy_state_s": round(gather_s, 4), "update_weights_s": round(copy_s, 4), "total_s": round(total_s, 4),
            "gb_per_s": round(size / 1e9 / total_s, 2),
        }
        del gathered
    # 2. Directly from a bf16 model on the same device (the best case in one process).
    source = state.get("packed_model") or new_model(config, device, dtype, seed=5)
    direct = {k: v.detach() for k, v in source.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    for _ in range(2):
        version += 1
        _, direct_s = timed(lambda: asyncio.run(engine.update_weights(state_dict=direct, version=version)))
    size = state_bytes(direct)
    out["engine_update_weights_same_device"] = {
        "what": "engine.update_weights(state_dict) from a bf16 model's tensors on the same device",
        "bytes": size, "total_s": round(direct_s, 4), "gb_per_s": round(size / 1e9 / direct_s, 2),
    }
    # 3. Disk: the trainer writes a transformers checkpoint, the engine reloads it.
    with tempfile.TemporaryDirectory(prefix="agentrl-gpu-sync-", dir=args.tmp) as tmp:
        directory = Path(tmp)
        if worker is not None:
            _, export_s = timed(lambda: worker.export_hf(str(directory)))
            how = "ActorWorker.export_hf (policy_state + hf_export.write_hf_checkpoint)"
        else:
            _, export_s = timed(lambda: source.save_pretrained(directory))
            how = "save_pretrained of a bf16 model"
        size = dir_bytes(directory)
        version += 1
        _, load_s = timed(lambda: asyncio.run(engine.update_weights(path=str(directory), version=version)))
        # the two halves alone: safetensors write of the engine's own bf16 tensors, and the read
        from safetensors.torch import save_file

        from agentrl.engines.weights import read_checkpoint

        bf16_dir = directory / "bf16"
        bf16_dir.mkdir()
        cpu_state = {k: v.detach().to("cpu").contiguous() for k, v in direct.items()}
        _, write_s = timed(lambda: save_file(cpu_state, str(bf16_dir / "model.safetensors")))
        bf16_size = dir_bytes(bf16_dir)
        _, read_s = timed(lambda: read_checkpoint(bf16_dir))
        out["disk"] = {
            "export": how, "dir": str(Path(args.tmp or tempfile.gettempdir())),
            "bytes": size, "export_s": round(export_s, 4), "engine_load_s": round(load_s, 4),
            "total_s": round(export_s + load_s, 4), "gb_per_s_total": round(size / 1e9 / (export_s + load_s), 2),
            "bf16_safetensors_bytes": bf16_size, "bf16_write_s": round(write_s, 4), "bf16_read_s": round(read_s, 4),
            "bf16_write_gb_per_s": round(bf16_size / 1e9 / write_s, 2), "bf16_read_gb_per_s": round(bf16_size / 1e9 / read_s, 2),
        }
    out["engine_weight_version"] = engine.weight_version
    return out


def part_export(args, device, state) -> dict:
    """Disk sync through ``hf_export.write_hf_checkpoint`` (the trainer's state written as it is, no
    model built), against ``safetensors.save_file`` of the same tensors, and the engine's reload."""
    from safetensors.torch import save_file

    from agentrl.trainer.hf_export import checkpoint_dtype, write_hf_checkpoint

    engine, worker = state.get("engine"), state.get("worker")
    if worker is None:
        raise RuntimeError("no actor worker (part actor_update failed)")
    source = Path(state["model_dir"])
    dtype = checkpoint_dtype(json.loads((source / "config.json").read_text()))
    out: dict = {"checkpoint_dtype": str(dtype)}
    root = Path(tempfile.mkdtemp(prefix="agentrl-gpu-export-", dir=args.tmp))
    version = 500
    for attempt in range(2):  # the second is reported
        t0 = now(device)
        policy = worker.policy_state()
        t1 = now(device)
        write_hf_checkpoint(policy, root / "ckpt", source=source)
        t2 = now(device)
        cast = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in policy.items()}
        t3 = time.perf_counter()
        save_file(cast, str(root / "raw.safetensors"))
        t4 = time.perf_counter()
        load_s = None
        if engine is not None:
            version += 1
            t5 = now(device)
            asyncio.run(engine.update_weights(path=str(root / "ckpt"), version=version))
            load_s = now(device) - t5
        del cast, policy
        out = {**out, "policy_state_s": round(t1 - t0, 4), "write_hf_checkpoint_s": round(t2 - t1, 4),
               "safetensors_save_file_same_tensors_s": round(t4 - t3, 4),
               "write_over_raw": round((t2 - t1) / max(t4 - t3, 1e-9), 2),
               "engine_load_s": round(load_s, 4) if load_s is not None else None,
               "sync_total_s": round((t2 - t0) + (load_s or 0.0), 4),
               "bytes": dir_bytes(root / "ckpt"), "files": sorted(p.name for p in (root / "ckpt").iterdir())}
    shutil.rmtree(root, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------- e

# Run in a child process, so that its peak GPU memory is its own and a hang is bounded by a timeout.
_TRAIN_CHILD = r"""
import json, sys, time, traceback
out_path, argv = sys.argv[1], sys.argv[2:]
result = {}
started = time.perf_counter()
try:
    import torch
    from agentrl.cli import main
    result["exit_code"] = main(argv)
except SystemExit as exc:
    result["exit_code"] = exc.code
except BaseException as exc:
    result["error"] = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-8:])
result["wall_s"] = round(time.perf_counter() - started, 2)
try:
    if torch.cuda.is_available():
        result["cuda_max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        result["cuda_max_memory_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
except BaseException as exc:
    result["memory_error"] = repr(exc)
json.dump(result, open(out_path, "w"))
"""

# The end-of-turn token's embedding row (tied: also its output row) is set to this multiple of a
# random unit vector, so that a random-weight model ends its turns after some tokens instead of
# at the length limit, and the interaction's retries make the episodes multi-turn.
EOS_ROW_SCALE = 8.0


def train_model_dir(config_shape: str, device: torch.device, dtype: torch.dtype, directory: Path) -> dict:
    """A model of ``config_shape`` (random weights) with the shipped tiny model's tokenizer and chat
    template, the end-of-turn row scaled (``EOS_ROW_SCALE``): what ``agentrl train`` starts from."""
    import json as _json

    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    import agentrl

    shipped = sorted((Path(agentrl.__file__).parent / "tiny_models").glob("*/tokenizer.json"))
    if not shipped:
        raise RuntimeError("no shipped tiny model under agentrl/tiny_models")
    source = shipped[0].parent
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    tiny = _json.loads((source / "config.json").read_text())
    shape = dict(SHAPES[config_shape])
    shape["vocab_size"] = max(shape["vocab_size"], tiny["vocab_size"])
    # the built-in engine sizes its KV cache slots by this (prompt + 5 turns fit well inside)
    shape["max_position_embeddings"] = 4096
    config = Qwen2Config(**shape, use_sliding_window=False, bos_token_id=tiny["bos_token_id"],
                         eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    with torch.no_grad():
        row = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(7))
        embed = model.get_input_embeddings().weight
        embed[config.eos_token_id] = (EOS_ROW_SCALE * row / row.norm()).to(embed.dtype).to(embed.device)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False)
    model.save_pretrained(directory)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": config.vocab_size,
            "tokenizer_from": source.name, "eos_row_scale": EOS_ROW_SCALE}


def train_overrides(args, model_dir: Path, runs_root: Path, run_name: str, weight_sync: str, steps: int) -> list[str]:
    tiny = args.shape == "tiny"
    return [
        f"model.path={model_dir}", "trainer=default", "data=arith_retry", "agent=tool_agent", "algorithm=grpo",
        f"trainer.device={args.device}", "trainer.workers=local", f"trainer.total_steps={steps}",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false",
        "trainer.save_rollouts=false", f"trainer.runs_root={runs_root}", f"trainer.run_name={run_name}",
        "logging.progress=false", "logging.loggers=[console,jsonl]",
        f"data.train_batch_size={2 if tiny else 8}", f"rollout.n={4 if tiny else 8}",
        f"actor.ppo_mini_batch_size={2 if tiny else 8}",
        f"actor.ppo_micro_batch_size_per_gpu={4 if tiny else 16}",
        "actor.use_kl_loss=true",  # a reference worker too
        f"rollout.max_new_tokens={16 if tiny else 64}", "data.max_response_length=512", "data.task_val_size=8",
        f"engine.max_batch_size={64}", f"engine.weight_sync={weight_sync}",
    ]


def summarize_train(run_dir: Path) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in lines if "timing/step_s" in m]
    keep = ("step", "tokens/per_s", "tokens/sampled", "response_length/mean", "turns/mean", "reward/mean", "logprob_mismatch/mean",
            "engine/generated_tokens", "engine/weight_version", "actor/pg_loss", "actor/grad_norm")
    per_step = []
    for m in steps:
        row = {k: round(v, 5) if isinstance(v, float) else v for k, v in m.items()
               if k.startswith("timing/") or k.startswith("finish/") or k in keep}
        if m.get("tokens/sampled") and m.get("timing/rollout_s"):  # sampled tokens over the rollout phase's wall time
            row["rollout_tokens_per_s"] = round(m["tokens/sampled"] / m["timing/rollout_s"], 1)
        per_step.append(row)
    out: dict = {"steps": per_step, "metric_keys": sorted({k for m in steps for k in m})}
    later = per_step[1:] or per_step  # the first step warms up (allocator, kernels)
    for key in sorted({k for r in later for k in r if k.startswith("timing/")} | {"rollout_tokens_per_s"}):
        values = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        if values:
            out.setdefault("median_after_first", {})[key] = round(statistics.median(values), 4)
    summary = run_dir / "summary.json"
    if summary.exists():
        data = json.loads(summary.read_text())
        out["startup"] = {k: v for k, v in data.items() if k.startswith("startup/")}
        out["job_wall_s"] = data.get("wall_s")
    return out


def part_train(args, device, dtype, state, *, weight_sync: str, steps: int) -> dict:
    """``agentrl train`` in one child process (one-rank groups in-process: no Ray)."""
    root = Path(tempfile.mkdtemp(prefix="agentrl-gpu-train-", dir=args.tmp))
    model_dir = state.get("train_model_dir")
    info = state.get("train_model_info", {})
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="agentrl-gpu-train-model-", dir=args.tmp))
        t0 = time.perf_counter()
        info = {**train_model_dir(args.shape, device, dtype, model_dir), "build_s": round(time.perf_counter() - t0, 2)}
        state["train_model_dir"], state["train_model_info"] = model_dir, info
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run_name = f"train-{weight_sync}"
    argv = ["train", *train_overrides(args, model_dir, root / "runs", run_name, weight_sync, steps)]
    result_file = root / f"{run_name}.json"
    env = dict(os.environ)
    if device.type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    log = root / f"{run_name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _TRAIN_CHILD, str(result_file), *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout=args.train_timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
    figures: dict = {"what": f"agentrl train in one process: GRPO, arith_retry (tool_agent + interaction), "
                             f"builtin engine, engine.weight_sync={weight_sync}, {steps} steps",
                     "model": info, "argv": argv, "timed_out": timed_out, "exit_code": proc.returncode,
                     "child_wall_s": round(time.perf_counter() - started, 2)}
    if result_file.exists():
        figures["child"] = json.loads(result_file.read_text())
    run_dir = root / "runs" / run_name
    try:
        figures.update(summarize_train(run_dir))
    except BaseException as exc:  # noqa: BLE001
        figures["summary_error"] = error_text(exc)
    text = log.read_text(errors="replace")
    figures["log_tail"] = text[-3000:]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{run_name}.log").write_text(text[-2_000_000:])
    shutil.rmtree(root, ignore_errors=True)  # the run; the model stays for the next train part
    return figures


# ---------------------------------------------------------------------------------------- d

_NCCL_CHILD = r"""
import os, sys, json, datetime, torch, torch.distributed as dist
rank = int(sys.argv[1]); path = sys.argv[2]; store_file = sys.argv[3]
out = {"rank": rank}
try:
    torch.cuda.set_device(0)
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("nccl", rank=rank, world_size=2, store=store, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    out["all_reduce_value"] = float(t[0])
    out["ok"] = out["all_reduce_value"] == 3.0
    dist.destroy_process_group()
except BaseException as exc:
    out["ok"] = False
    out["error"] = f"{type(exc).__name__}: {exc}"[:3000]
json.dump(out, open(path, "w"))
"""


def part_nccl_two_processes(args, device) -> dict:
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    with tempfile.TemporaryDirectory(prefix="agentrl-nccl-") as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(_NCCL_CHILD)
        env = {**os.environ, "NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        procs = [subprocess.Popen([sys.executable, str(script), str(r), f"{tmp}/r{r}.json", f"{tmp}/store"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        logs, timed_out = [], False
        for p in procs:
            try:
                logs.append(p.communicate(timeout=args.nccl_timeout)[0])
            except subprocess.TimeoutExpired:
                timed_out = True
                p.kill()
                logs.append(p.communicate()[0])
        ranks = []
        for r in range(2):
            f = Path(tmp) / f"r{r}.json"
            ranks.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "ok": False, "error": "no result"})
        return {"works": all(r.get("ok") for r in ranks), "timed_out": timed_out, "ranks": ranks,
                "exit_codes": [p.returncode for p in procs],
                "nccl_log_tail": [log[-1500:] for log in logs],
                "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None}


# ---------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 16 64 (tiny: 1 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny: 8)")
    parser.add_argument("--rows", type=int, default=None, help="update rows; default 64 (tiny: 8)")
    parser.add_argument("--group", type=int, default=8, help="rows sharing a prompt (GRPO n); tiny: 4")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 16 (tiny: 4)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["engine", "engine_no_graphs", "engine_agreement", "generate", "actor_update", "actor_update_fsdp2",
                                                       "packed_update", "weight_sync", "export", "nccl_two_processes",
                                                       "train", "train_disk"])
    parser.add_argument("--nccl-timeout", type=float, default=120.0)
    parser.add_argument("--train-steps", type=int, default=None, help="agentrl train's steps; default 4 (tiny: 2)")
    parser.add_argument("--train-timeout", type=float, default=None, help="seconds for each agentrl train run; default 200 (tiny: 600)")
    parser.add_argument("--tmp", default=None, help="directory for checkpoints (default: the system's temp dir)")
    args = parser.parse_args()
    tiny = args.shape == "tiny"
    args.concurrency = args.concurrency or ([1, 4] if tiny else [1, 16, 64])
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new_tokens = args.new_tokens or (8 if tiny else 128)
    args.response_len = args.new_tokens
    args.rows = args.rows or (8 if tiny else 64)
    if tiny and args.group == 8:
        args.group = 4
    args.micro_batch = args.micro_batch or (4 if tiny else 16)
    args.train_steps = args.train_steps or (2 if tiny else 4)
    args.train_timeout = args.train_timeout or (600.0 if tiny else 200.0)

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    results: dict = {"command": " ".join(sys.argv), "args": {k: v for k, v in vars(args).items()}}
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "device": str(device), "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_gb=round(props.total_memory / 1e9, 1),
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    results["env"] = env
    config = make_config(args.shape)
    state: dict = {}

    def setup() -> dict:
        model = new_model(config, device, dtype, seed=0)
        params = sum(p.numel() for p in model.parameters())
        directory = Path(tempfile.mkdtemp(prefix="agentrl-gpu-model-", dir=args.tmp))
        t0 = time.perf_counter()
        save_model_dir(model, directory)
        state["model_dir"] = directory
        return {"parameters": params, "shape": SHAPES[args.shape], "dtype": args.dtype,
                "save_pretrained_s": round(time.perf_counter() - t0, 3), "model_dir_bytes": dir_bytes(directory)}

    run_part(results, "model", setup)
    if "model_dir" not in state:
        print(json.dumps(results, indent=1))
        return 1
    parts = {
        "engine": lambda: part_engine(config, args, device, dtype, state),
        "engine_no_graphs": lambda: part_engine(config, args, device, dtype, state, graphs=False),
        "engine_agreement": lambda: part_engine_agreement(config, args, device, dtype),
        "generate": lambda: part_generate(config, args, device, dtype),
        "actor_update": lambda: part_actor_update(args, device, state),
        "packed_update": lambda: part_packed_update(config, args, device, dtype, state),
        "weight_sync": lambda: part_weight_sync(config, args, device, dtype, state),
        "nccl_two_processes": lambda: part_nccl_two_processes(args, device),
        "actor_update_fsdp2": lambda: part_actor_update_fsdp2(args, device, state),
        "export": lambda: part_export(args, device, state),
        "train": lambda: part_train(args, device, dtype, state, weight_sync="memory", steps=args.train_steps),
        "train_disk": lambda: part_train(args, device, dtype, state, weight_sync="disk", steps=max(2, args.train_steps // 2)),
    }
    for name in args.parts:
        if name.startswith("train") and not state.get("released"):
            release(state, device)  # the agentrl train runs are child processes: free this one's GPU memory first
        run_part(results, name, parts[name])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_out(results)  # after every part: a run stopped at its time limit keeps what it measured
    release(state, device)
    for key in ("model_dir", "train_model_dir"):
        if state.get(key) is not None:
            shutil.rmtree(state[key], ignore_errors=True)
    results["total_wall_s"] = round(time.perf_counter() - started, 2)
    print(write_out(results))
    return 0


def release(state: dict, device: torch.device) -> None:
    """Close the engine and drop the models the parts kept."""
    import gc

    engine = state.pop("engine", None)
    if engine is not None:
        engine.close()
    for key in ("worker", "worker_fsdp2", "packed_model"):
        state.pop(key, None)
    state["released"] = True
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_out(results: dict) -> str:
    text = json.dumps(results, indent=1, default=str)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())

"""The first turn's tool-call rate on the calculator race's warm start: the built-in engine against
transformers' ``generate`` (TRL's sampler), both against the exact rate the policy implies.

The race (``agentrl bench trainer --task calculator``) starts both trainers from one warm start;
whether a first turn calls the calculator is decided by its first token (``<tool_call>`` is one
token). Here the race's warm start (``trainer_calculator.warm_start``, the given seed) is built,
the race's training prompts are rendered once with the tools (the string TRL renders, checked
equal to agentrl's rendering), and the first token is sampled at temperature 1:

* by the built-in engine, the samples of a prompt submitted together as one group (the runner's
  way), each request with its own seed;
* by ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1)`` on left-padded batches
  of prompts repeated ``--n`` times (TRL's ``_generate_single_turn`` with transformers' generate);

and compared with the exact expectation, the mean over the prompts of ``softmax(logits)[<tool_call>]``
from one full forward: each rate with its binomial standard error and its distance from the
expectation in standard errors. Prints one JSON object.

    python -m agentrl_benchmarks.first_turn [--seed 0] [--prompts 256] [--n 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

__all__ = ["main"]


def _rendered_prompts(tokenizer, rows) -> list[list[int]]:
    from agentrl_tools.calculator import CalculatorTool

    from agentrl_benchmarks.trainer_calculator import trl_parts

    _, _, trl_kwargs = trl_parts(tokenizer, SimpleNamespace(seed=0, prompts=1, steps=1))
    prompts = []
    for row in rows:
        ours = tokenizer.apply_chat_template(row["prompt"], tools=[CalculatorTool.schema()], add_generation_prompt=True, tokenize=False)
        theirs = tokenizer.apply_chat_template(row["prompt"], tools=trl_kwargs["tools"], add_generation_prompt=True, tokenize=False)
        if ours != theirs:
            raise RuntimeError(f"agentrl and TRL render the prompt differently:\n{ours!r}\n{theirs!r}")
        prompts.append(tokenizer(ours, add_special_tokens=False)["input_ids"])
    return prompts


def _rate(hits: int, n: int, expected: float) -> dict[str, float]:
    rate = hits / n
    se = math.sqrt(expected * (1 - expected) / n)
    return {"rate": round(rate, 4), "n": n, "se": round(math.sqrt(rate * (1 - rate) / n), 4), "z_vs_exact": round((rate - expected) / se, 2)}


async def _engine_first_tokens(model, prompts: list[list[int]], n: int, seed: int) -> list[int]:
    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.builtin import BuiltinEngine

    engine = BuiltinEngine(model, max_batch_size=64, seed=seed)
    try:
        requests = [GenerateRequest(p, SamplingParams(max_new_tokens=1, temperature=1.0, seed=seed * 1_000_003 + k * n + i))
                    for k, p in enumerate(prompts) for i in range(n)]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        engine.close()
    return [r.output_ids[0] for r in results]


def _generate_first_tokens(model, tokenizer, prompts: list[list[int]], n: int, seed: int, batch: int = 64) -> list[int]:
    import torch

    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(n)]
    firsts = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in chunk])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=1, pad_token_id=tokenizer.pad_token_id)
        firsts += out[:, width].tolist()
    return firsts


def main(argv: list[str] | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl_benchmarks.trainer_calculator import train_rows, warm_start

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        policy = warm_start(Path(tmp) / "warm", SimpleNamespace(seed=args.seed))
        tokenizer = AutoTokenizer.from_pretrained(policy)
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    rows = train_rows(SimpleNamespace(seed=args.seed, prompts=args.prompts, steps=1))
    prompts = _rendered_prompts(tokenizer, rows)
    call = tokenizer.convert_tokens_to_ids("<tool_call>")
    with torch.no_grad():
        exact = [float(torch.softmax(model(torch.tensor([p])).logits[0, -1].float(), -1)[call]) for p in prompts]
    expected = sum(exact) / len(exact)
    engine = asyncio.run(_engine_first_tokens(model, prompts, args.n, args.seed))
    generate = _generate_first_tokens(model, tokenizer, prompts, args.n, args.seed)
    total = len(prompts) * args.n
    result = {
        "seed": args.seed, "prompts": len(prompts), "samples_per_prompt": args.n,
        "exact_rate": round(expected, 4),
        "builtin_engine": _rate(sum(t == call for t in engine), total, expected),
        "transformers_generate": _rate(sum(t == call for t in generate), total, expected),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

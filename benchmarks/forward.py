"""``agentrl bench forward``: the trainer's two forward paths side by side on one batch.

Times forward + backward of the response logprobs (``prefix.response_logprobs``) through the
packed forward (``packed.py``) and through the module path with shared prompts and length buckets
(what FSDP2 and gradient checkpointing use), alternating the two so that the machine's drift
hits both alike, and prints one JSON object with each batch's medians and their ratio. Batches:

* ``grpo``: 8 prompts of the trainer benchmark ("Say seven. (i)") x 8 samples, responses of
  1-8 random tokens (seeded), the shape of ``agentrl bench trainer``'s batches;
* ``sft``: 32 of the quickstart's tool-use demonstrations (one-token "prompt", the whole
  conversation as the response), the shape of its SFT batches.

    agentrl bench forward --json [--model-size 1m] [--repeats 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

__all__ = ["main"]


def _grpo_batch(tokenizer, seed: int):
    import torch

    from agentrl.trainer.batch import collate_sequences
    from agentrl_benchmarks.trainer import _prompt

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(8):
        ids = tokenizer.apply_chat_template(_prompt(i), add_generation_prompt=True, return_dict=True)["input_ids"]
        for _ in range(8):
            prompts.append(list(ids))
            responses.append(torch.randint(3, tokenizer.vocab_size, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist())
    return collate_sequences(prompts, responses, [[1] * len(r) for r in responses], pad_token_id=tokenizer.pad_token_id)


def _sft_batch(tokenizer, seed: int):
    from agentrl.config import load_config
    from agentrl.trainer.sft import sft_batches, tokenize_conversations, tool_schemas
    from agentrl_data_prep.tasks import sft_conversations

    cfg = load_config("train", [])
    conversations = sft_conversations(cfg.data.task, 32, seed=seed, informal_rate=cfg.sft.informal_rate)
    examples = tokenize_conversations(tokenizer, conversations, tools=tool_schemas(cfg, conversations), max_length=cfg.sft.max_length)
    return sft_batches(examples, batch_size=32, pad_token_id=tokenizer.pad_token_id, epochs=1, seed=seed)[0]


def compare(model, batch, repeats: int) -> dict[str, float]:
    """Median seconds of forward + backward on each path, alternating; packed first each round."""
    from agentrl.trainer import packed
    from agentrl.trainer.prefix import response_logprobs

    supported = packed.packed_supported

    def step(use_packed: bool) -> float:
        packed.packed_supported = supported if use_packed else (lambda model, batch: False)
        started = time.perf_counter()
        model.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(model, batch)
        ((logprobs * batch.response_mask).sum() / batch.response_mask.sum()).backward()
        return time.perf_counter() - started

    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeats + 2):  # the first two rounds warm up
            for use_packed in (True, False):
                times[use_packed].append(step(use_packed))
    finally:
        packed.packed_supported = supported
    packed_s, module_s = (statistics.median(times[flag][2:]) for flag in (True, False))
    return {"packed_s": packed_s, "module_s": module_s, "ratio": module_s / packed_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench forward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--model-size", default="1m")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.tiny import tiny_model_dir

    torch.set_num_threads(args.threads)
    path = tiny_model_dir(args.model_size, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    for name, batch in (("grpo", _grpo_batch(tokenizer, args.seed)), ("sft", _sft_batch(tokenizer, args.seed))):
        result = compare(model, batch, args.repeats)
        out[name] = {"rows": len(batch), "columns": batch.input_ids.shape[1], **{k: round(v, 4) for k, v in result.items()}}
    if not args.json:
        for name in ("grpo", "sft"):
            r = out[name]
            print(f"{name}: packed {r['packed_s'] * 1000:.1f} ms, module path {r['module_s'] * 1000:.1f} ms", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

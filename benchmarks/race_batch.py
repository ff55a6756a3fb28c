"""One recorded batch of the calculator race through both trainers' losses.

TRL 1.16's ``GRPOTrainer`` (the race's ``GRPOConfig`` and tools) samples one batch on the race's warm
start with its own tool loop (``_generate_and_score_completions``: ``--prompts`` prompts x ``--n``
samples); that batch, token for token (prompts, completions, the tool mask), goes through

* TRL's loss (``compute_loss``, ``loss_type="dapo"``) and its gradient (the race's ``GRPOConfig``,
  ``trainer.trl_config``: fp32; ``--trl-bf16``: TRL's default ``bf16=True``, under which the loss's
  forward runs in the CPU's bf16 autocast and its gradient is off the exact one: docs/learning.md), and
* agentrl's actor update (``ActorWorker.update``, ``token-mean``, one rank in this process, plain
  SGD at learning rate 1 with no clipping, so the gradient is read off as the trainer computed it),
  with agentrl's GRPO advantages of the same 0/1 rewards;

and the two are compared: loss tokens, advantages, gradient norms, the cosine of the two gradients.
Also the batch's trajectory statistics (sampled tokens, tool use, reward). Prints one JSON object.

    python -m agentrl_benchmarks.race_batch [--seed 0] [--batch 0] [--prompts 8] [--n 8] [--start DIR] [--trl-bf16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["main", "compare"]


def _trl_trainer(start: Path, work: Path, settings: Any, prompts: int, trl_bf16: bool) -> tuple[Any, list[dict[str, Any]]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from agentrl_benchmarks import trainer_calculator as calculator
    from agentrl_benchmarks.trainer import trl_config

    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    rows, reward, parts = calculator.trl_parts(tokenizer, settings)
    # the race's own config (fp32 unless trl_bf16: TRL's default), one step of `prompts` x `settings.n`
    config = trl_config(settings, work / "trl", per_device_train_batch_size=prompts * settings.n, max_steps=1, bf16=trl_bf16,
                        **parts["config"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, tools=parts["tools"])
    return trainer, rows


def compare(start: Path, work: Path, *, seed: int = 0, batch: int = 0, prompts: int = 8, n: int = 8,
            trl_bf16: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from agentrl.config.schema import ActorConfig, OptimConfig
    from agentrl.trainer.algorithms.advantages import compute_grpo_advantages
    from agentrl.trainer.batch import collate_sequences
    from agentrl.trainer.dist import free_port
    from agentrl.trainer.rank import mini_batch_denominator
    from agentrl.trainer.workers import ActorWorker
    from agentrl_benchmarks.trainer import TASK_DEFAULTS, Settings

    settings = Settings(**{"task": "calculator", **TASK_DEFAULTS["calculator"], "seed": seed, "prompts": prompts * (batch + 1),
                           "n": n, "steps": 1})
    trainer, rows = _trl_trainer(start, work, settings, prompts, trl_bf16)
    trainer.model.train()
    out = trainer._generate_and_score_completions([rows[batch * prompts + k] for k in range(prompts) for _ in range(n)])
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    trainer.compute_loss(trainer.model, out).backward()
    trl_grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}

    rows_n = out["completion_ids"].shape[0]
    lengths = [int(x) for x in out["completion_mask"].sum(1)]
    tool_mask = out.get("tool_mask", torch.ones_like(out["completion_mask"]))
    prompt_ids = [out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist() for r in range(rows_n)]
    responses = [out["completion_ids"][r][: lengths[r]].tolist() for r in range(rows_n)]
    masks = [tool_mask[r][: lengths[r]].tolist() for r in range(rows_n)]
    trl_advantages = out["advantages"]
    scores = (trl_advantages > 0).float()  # 0/1 rewards: a sample above its group's mean scored 1
    ours = compute_grpo_advantages(scores, torch.arange(rows_n) // n)

    actor = ActorWorker(
        model_path=str(start), total_steps=1, temperature=1.0, rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), device="cpu", seed=seed,
        config=ActorConfig(optim=OptimConfig(optimizer="SGD", lr=1.0, grad_clip=1e9), ppo_mini_batch_size=rows_n,
                           ppo_micro_batch_size_per_gpu=rows_n, loss_agg_mode="token-mean",
                           clip_ratio_low=settings.clip_ratio, clip_ratio_high=settings.clip_ratio),
    )
    try:
        collated = collate_sequences(prompt_ids, responses, masks, pad_token_id=trainer.processing_class.pad_token_id)
        mask = collated.response_mask
        current, _ = actor.compute_logprobs(collated, rows_n)
        collated = collated.replace(old_logprobs=current, advantages=ours[:, None] * mask)
        actor.update([collated], [mini_batch_denominator(mask, "token-mean")], use_kl_loss=False)
        our_grads = {name: p.grad.detach().clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hand_grads = _by_hand_gradient(start, prompt_ids, responses, masks, ours)
    names = sorted(set(trl_grads) & set(our_grads) & set(hand_grads))
    a = torch.cat([trl_grads[k].flatten() for k in names]).double()
    b = torch.cat([our_grads[k].flatten() for k in names]).double()
    h = torch.cat([hand_grads[k].flatten() for k in names]).double()
    call = trainer.processing_class.convert_tokens_to_ids("<tool_call>")
    calls = [sum(1 for t, m in zip(r, k) if m and t == call) for r, k in zip(responses, masks)]
    return {
        "seed": seed, "batch": batch, "trl_bf16": trl_bf16, "trajectories": rows_n,
        "sampled_tokens_mean": round(float(mask.sum()) / rows_n, 2), "tool_use": round(sum(c > 0 for c in calls) / rows_n, 4),
        "reward_mean": round(float(trainer._metrics["train"]["reward"][-1]), 4),
        "groups_with_signal": int(sum(bool(trl_advantages[g * n:(g + 1) * n].abs().sum() > 0) for g in range(prompts))),
        "loss_tokens": {"trl": int((out["completion_mask"] * tool_mask).sum()), "agentrl": int(mask.sum())},
        "advantages_max_abs_diff": float((trl_advantages - ours).abs().max()),
        "parameters": {"compared": len(names), "trl": len(trl_grads), "agentrl": len(our_grads)},
        "grad_norm": {"trl": round(float(a.norm()), 6), "agentrl": round(float(b.norm()), 6)},
        "cosine": round(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), 6),
        "relative_difference": round(float((a - b).norm() / a.norm()), 6),
        # the same loss written out, each row on its own (no padding, no shared prompt)
        "by_hand": {"grad_norm": round(float(h.norm()), 6),
                    "relative_difference_trl": round(float((a - h).norm() / h.norm()), 6),
                    "relative_difference_agentrl": round(float((b - h).norm() / h.norm()), 6)},
    }


def _by_hand_gradient(start: Path, prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]],
                      advantages: Any) -> dict[str, Any]:
    """The gradient of -sum(A * logp * mask) / sum(mask) (the ratio is 1 at the sampling policy),
    each row's logprobs from its own unpadded forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    total = sum(map(sum, masks))
    for prompt, response, mask, advantage in zip(prompts, responses, masks, advantages.tolist()):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        (-(advantage * logp * torch.tensor(mask, dtype=logp.dtype)).sum() / total).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from agentrl_benchmarks.trainer_calculator import warm_start

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=0, help="which batch of the race's prompts (0: its first step's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--start", type=Path, help="a warm start already built (default: build the race's for --seed)")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL's own default bf16=True (the race sets False): its loss forward under the CPU's bf16 autocast")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        start = args.start or warm_start(Path(tmp) / "start", SimpleNamespace(seed=args.seed))
        result = compare(start, Path(tmp), seed=args.seed, batch=args.batch, prompts=args.prompts, n=args.n, trl_bf16=args.trl_bf16)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

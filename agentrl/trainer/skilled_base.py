"""The tiny model with tool skills: the quickstart's stand-in for a pretrained instruct model.

A user starts RL from a model that already knows how to call a tool and read its result; the
tiny model starts from random weights, and a 1M-parameter model needs several hundred steps of
demonstrations before it copies numbers from a tool result into its answer (an induction-style
skill that appears abruptly, not gradually). agentrl ships that model, built by the current recipe
(``agentrl/tiny_models``, written by scripts/build_skilled_base.py); without it (another size or
seed, a changed recipe) ``skilled_model_dir`` builds it once per machine, cached beside the tiny
model: demonstrations of calculator use on the ``word`` task
(several calls each, where copying appears soonest), then on the ``arith`` questions, each
stage stopped by a held-out check (``agentrl.tiny.SKILLS`` holds the recipe). The quickstart's
warm start then gives the policy the habit of not using the tool, and RL the habit of using it.

Built in this process (one model, no Ray, no FSDP), with the trainer's own SFT batching and
shared-prompt forward, deterministic for a (size, seed, transformers version).
"""

from __future__ import annotations

import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.tiny import SKILL_BASES, SKILLS, build_once, resolve_model, shipped_skilled_model, skilled_model_path

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig

__all__ = ["skilled_model_dir", "ensure_model", "greedy_exact", "check_batch"]

CHECK_DEMOS = 128
CHECK_EVERY = 50
TARGET = 0.97


def skilled_model_dir(skill: str, size: str = "1m", seed: int = 0, cache_root: str | Path | None = None) -> Path:
    """The tiny model of ``size`` after ``skill``'s demonstrations (``agentrl.tiny.SKILLS``), built
    once into the cache beside the tiny model and reused afterwards."""
    final = skilled_model_path(skill, size, seed, cache_root)  # refuses an unknown skill
    if (final / "config.json").is_file():
        return final
    base = _start_of(skill, size, seed, cache_root)
    return build_once(final, lambda staging: _train(base, staging, skill, seed))


def _start_of(skill: str, size: str, seed: int, cache_root: str | Path | None) -> Path:
    """The model ``skill``'s stages start from: the tiny model, or the model of the skill it is
    built on (``SKILL_BASES``), shipped or built."""
    from agentrl.tiny import tiny_model_dir

    on = SKILL_BASES.get(skill)
    if on is None:
        return tiny_model_dir(size, seed=seed, cache_root=cache_root)
    return shipped_skilled_model(on, size, seed) or skilled_model_dir(on, size, seed, cache_root)


def ensure_model(cfg: "TrainConfig") -> Path:
    """``resolve_model`` for the commands that train: the tiny model's skills are built first if
    the config asks for them, agentrl does not ship them and this machine has not built them yet."""
    tiny = cfg.model.tiny
    if cfg.model.path is None and tiny.skills != "none" and shipped_skilled_model(tiny.skills, tiny.size, tiny.seed) is None:
        skilled_model_dir(tiny.skills, tiny.size, seed=tiny.seed)
    return resolve_model(cfg)


def greedy_exact(model, batch) -> float:
    """The share of ``batch``'s rows whose every trained token is the model's argmax (teacher forced:
    what greedy decoding would write, token for token)."""
    import torch

    training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    model.train(training)
    P = batch.prompt_length
    predicted = logits[:, P - 1 : -1].argmax(-1)
    trained = batch.response_mask.bool()
    return float(((predicted == batch.input_ids[:, P:]) | ~trained).all(-1).float().mean())


def check_batch(tokenizer, task: str, seed: int, stage: int):
    """The held-out demonstrations that stop a stage: another draw of the train split than the
    stage trains on (the quickstart validates on the test split)."""
    from agentrl.plugins import PluginRegistry
    from agentrl.trainer.sft import sft_batches, tokenize_conversations
    from agentrl_data_prep.tasks import sft_conversations

    tools = [PluginRegistry().load("tools", "calculator").schema()]
    heldout = tokenize_conversations(tokenizer, sft_conversations(task, CHECK_DEMOS, seed=seed + 2000 + stage), tools=tools, max_length=512)
    return sft_batches(heldout, batch_size=CHECK_DEMOS, pad_token_id=tokenizer.pad_token_id, epochs=1, seed=0)[0]


def _warmup_cosine(step: int, *, steps: int, warmup: int = 20) -> float:
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))


def _train(base: Path, out: Path, skill: str, seed: int) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.plugins import PluginRegistry
    from agentrl.trainer.prefix import response_logprobs
    from agentrl.trainer.sft import sft_batches, tokenize_conversations
    from agentrl_data_prep.tasks import sft_conversations

    started = time.perf_counter()
    print(f"building the tiny model with {skill} skills (once per machine, cached in {out.parent})", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tools = [PluginRegistry().load("tools", "calculator").schema()]
    model.train()
    for stage, (task, data_seed, batch_size, lr, steps) in enumerate(SKILLS[skill]):
        conversations = sft_conversations(task, steps * batch_size, seed=seed + data_seed, tool_rate=1.0)
        examples = tokenize_conversations(tokenizer, conversations, tools=tools, max_length=512)
        batches = sft_batches(examples, batch_size=batch_size, pad_token_id=tokenizer.pad_token_id, epochs=1, seed=seed)
        check = check_batch(tokenizer, task, seed, stage)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_warmup_cosine, steps=steps))
        bar = tqdm(batches, desc=f"{skill} skills: {task}", unit="step", file=sys.stderr)
        for step, batch in enumerate(bar, start=1):
            logprobs, _ = response_logprobs(model, batch)
            loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            if step % CHECK_EVERY == 0:
                exact = greedy_exact(model, check)
                bar.set_postfix(heldout_exact=f"{exact:.2f}")
                if exact >= TARGET:
                    break
        else:
            raise RuntimeError(f"the {skill} skills did not reach {TARGET:.0%} held-out exactness on {task} within {steps} steps")
        bar.close()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"built in {time.perf_counter() - started:.0f} s: {out.parent / out.name}", file=sys.stderr, flush=True)

"""``agentrl bench history``: what training on histories as the model sees them at inference costs.

Episodes of T assistant turns on the released Qwen3 chat template (the tiny model's weights under
it: the template and the tokenizer are what decide the tokens): each turn reasons in a
``<think>`` block and answers; the GSM8K interaction calls every answer but the last incorrect and
asks again. Qwen3's template drops the reasoning of turns before the last user turn, so under
``agent.history=as_template`` every retry starts a new segment whose prompt is the whole
conversation so far without the earlier reasoning; under ``as_sampled`` the episode is one
stream. The episodes run through the real ``tool_agent`` loop (a scripted engine writes the turns),
and the trainer's batch is built as a training step builds it (``with_earlier_segments``,
``collate``). For each T and each way of computing the batch:

* ``as_sampled``: one row per trajectory;
* ``as_template``: the trajectory and its earlier segments as prefix trees (the packed forward:
  every shared token once);
* ``as_template_rows``: the same rows computed one forward each (what naive per-segment rows, or
  per-turn samples, cost);

it reports the tokens the forward computes (``computed``: the trees as the packer cuts them, which
trades recomputed tokens for less attention over long trees), per sampled (trained) token, and
their ratio to ``as_sampled``; the unique tokens of the uncut trees (``tree_tokens``); the median seconds of forward + backward of the response logprobs (the
three alternating, repeated); and the bytes the autograd graph saves for backward (activation
memory). Floor (issue #45): ``as_template`` at most 1.3x the forward tokens of ``as_sampled`` at
16 turns; naive rows cost about T/2x.

    agentrl bench history --json [--turns 4,16,32] [--rows 4] [--repeats 5] [--model-size 1m]
        [--chat-template tests/fixtures/families/qwen3/chat_template.jinja]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

__all__ = ["main", "episodes", "MODES"]

MODES = ("as_sampled", "as_template", "as_template_rows")
REPO_TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "families" / "qwen3" / "chat_template.jinja"
WORDS = "first the tens then the units carry one check the product again against the question so".split()


def _turn_text(row: int, turn: int, last: bool, reasoning_words: int) -> str:
    words = " ".join(WORDS[(row + turn + i) % len(WORDS)] for i in range(reasoning_words))
    answer = "408" if last else str(500 + turn)  # every answer but the last is wrong
    return f"<think>\nAttempt {turn + 1}: {words}.\n</think>\n\n#### {answer}"


def episodes(tokenizer, turns: int, history: str, *, rows: int = 4, reasoning_words: int = 40):
    """``rows`` trajectories of ``turns`` assistant turns under ``history`` (as_sampled or
    as_template), through the real loop."""
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import AgentConfig, DataConfig, TrainConfig
    from agentrl.data.row import Row

    def script(row_id: str, index: int, request) -> str:
        return _turn_text(int(row_id[1:]), index, index == turns - 1, reasoning_words)

    cfg = TrainConfig(agent=AgentConfig(history=history, max_assistant_turns=turns, max_user_turns=turns),
                      data=DataConfig(max_response_length=1 << 16))
    ctx = build_context(ScriptedEngine(tokenizer, script, record_requests=False), tokenizer, RolloutSetup.from_config(cfg),
                        tool_names=[])
    data = [(f"r{i}", Row.model_validate({
        "data_source": "agentrl/arith", "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": "Answer with #### and the number."},
                   {"role": "user", "content": f"What is 12 * 34? (question {i})"}],
        "reward_model": {"style": "rule", "ground_truth": "408"},
        "extra_info": {"index": i, "interaction_kwargs": {"name": "gsm8k", "ground_truth": "408"}},
    })) for i in range(rows)]
    trajectories = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(data))
    bad = [t for t in trajectories if t.finish_reason != "interaction_done" or t.metrics["turns"] != turns]
    if bad:
        raise RuntimeError(f"an episode did not play its {turns} turns: {bad[0].finish_reason}, {bad[0].metrics}")
    return trajectories


def batch_of(trajectories, pad_token_id: int):
    from agentrl.trainer.batch import collate
    from agentrl.trainer.step import with_earlier_segments

    rows, _, _ = with_earlier_segments(trajectories)
    return collate(rows, pad_token_id=pad_token_id)


def _step(model, batch, share: bool) -> tuple[float, int]:
    """Seconds of forward + backward of the response logprobs, and the bytes saved for backward."""
    import torch

    from agentrl.trainer.prefix import response_logprobs

    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    started = time.perf_counter()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = response_logprobs(model, batch, share_prompts=share)
    ((logprobs * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    return time.perf_counter() - started, saved[0]


def measure(model, tokenizer, turns: int, *, rows: int, repeats: int, reasoning_words: int) -> dict:
    from agentrl.trainer import packed

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = {policy: batch_of(episodes(tokenizer, turns, policy, rows=rows, reasoning_words=reasoning_words), pad)
               for policy in ("as_sampled", "as_template")}
    plan = {"as_sampled": (batches["as_sampled"], True), "as_template": (batches["as_template"], True),
            "as_template_rows": (batches["as_template"], False)}
    pair_cost = packed.attention_pair_cost(model.config)
    out: dict = {}
    for mode, (batch, share) in plan.items():
        tokens = packed.forward_tokens(batch, share=share, pair_cost=pair_cost)
        unique = packed.forward_tokens(batch, share=share).computed  # one tree, no cut for attention's sake
        out[mode] = {"rows": len(batch), "computed": tokens.computed, "tree_tokens": unique, "row_tokens": tokens.rows,
                     "trained": tokens.trained, "computed_per_trained": round(tokens.computed / tokens.trained, 3)}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    saved: dict[str, int] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        for mode in order:
            seconds, saved[mode] = _step(model, *plan[mode])
            if round_:
                times[mode].append(seconds)
    base = out["as_sampled"]
    for mode in MODES:
        out[mode].update(step_s=round(statistics.median(times[mode]), 4), saved_mb=round(saved[mode] / 2**20, 2),
                         computed_vs_sampled=round(out[mode]["computed"] / base["computed"], 3),
                         tree_vs_sampled=round(out[mode]["tree_tokens"] / base["tree_tokens"], 3))
        out[mode]["step_vs_sampled"] = round(out[mode]["step_s"] / base["step_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench history", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--turns", default="4,16,32", help="assistant turns per episode, comma-separated")
    parser.add_argument("--rows", type=int, default=4, help="episodes per batch")
    parser.add_argument("--reasoning-words", type=int, default=40, help="words of each turn's <think> block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-size", default="1m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chat-template", default=str(REPO_TEMPLATE), help="a Qwen3-style template (drops earlier reasoning)")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.tiny import tiny_model_dir, with_chat_template

    if not Path(args.chat_template).is_file():
        parser.error(f"--chat-template: {args.chat_template} not found (the released Qwen3 template ships in the repository's "
                     "tests/fixtures/families/qwen3/)")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    path = with_chat_template(tiny_model_dir(args.model_size), args.chat_template)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    out: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    for turns in (int(t) for t in args.turns.split(",")):
        out[f"turns_{turns}"] = measure(model, tokenizer, turns, rows=args.rows, repeats=args.repeats,
                                        reasoning_words=args.reasoning_words)
        if not args.json:
            r = out[f"turns_{turns}"]
            print(f"{turns} turns: computed tokens vs as_sampled: as_template {r['as_template']['computed_vs_sampled']}x, "
                  f"per-segment rows {r['as_template_rows']['computed_vs_sampled']}x; step {r['as_template']['step_vs_sampled']}x / "
                  f"{r['as_template_rows']['step_vs_sampled']}x", file=sys.stderr)
    out["wall_s"] = round(time.perf_counter() - started, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

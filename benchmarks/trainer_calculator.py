"""``agentrl bench trainer --task calculator``: the race on a multi-turn tool task.

Arithmetic questions answered with the calculator tool (``data_prep.tasks``' ``arith``: the
system prompt asks for the tool and for ``#### <number>``): the policy writes a call, the tool's
result comes back as a turn, the policy answers, possibly after more calls. Both sides start from
the same warm start: the calculator-skilled base (``agentrl/tiny_models``) after SFT on a
demonstrator who answers most questions at once, "mentally" and one digit wrong
(``sft_conversations(tool_rate=...)``, as the quickstart's warm start), so that calling the
tool, and copying the question into the call right, is what RL has to reinforce. The reward is verl's strict GSM8K check of the last answer
(``gsm8k``) on both sides.

agentrl runs its own tool loop (``tool_agent``: the built-in engine, the calculator plugin,
observations masked out of the loss). TRL runs its own: ``GRPOTrainer(tools=[calculator])``
(TRL 1.16.0: each turn one padded ``generate`` over the samples still calling tools, results
appended as tool messages and masked out of the loss, ``max_tool_calling_iterations`` rounds);
its tool is a plain function with the calculator plugin's own arithmetic
(``agentrl_tools.calculator.evaluate``), and agentrl's tiny chat template writes calls as Qwen's
do, so TRL parses them with its Qwen3 response template. Matched: the response budget over all
turns (``max_new_tokens``: TRL's ``max_completion_length``, agentrl's ``data.max_response_length``
and per-turn cap alike), at most ``TOOL_ROUNDS`` calls then an answer, no KL, the same
optimizer settings. Both are evaluated by one evaluator: ``agentrl rollout`` of the tool loop on
held-out questions (``--eval-prompts``, default ``EVAL_QUESTIONS``), ``--eval-samples`` each (default
``EVAL_SAMPLES``) at temperature 1, fixed seeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TOOL_ROUNDS", "warm_start", "train_rows", "evaluate", "agentrl_overrides", "trl_parts"]

TASK = "arith"
TOOL_ROUNDS = 3  # calls before the answer must come (TRL's max_tool_calling_iterations)
EVAL_QUESTIONS = 64
EVAL_SAMPLES = 4
WARM_START_DEMOS = 1024
# the demonstrator's tool use: twice the quickstart's, because this warm start is a third as long
# and at the quickstart's rate it left a policy that almost never called the tool and never
# succeeded, nothing for RL to reinforce (the probe's figures: docs/benchmarks.md, the calculator race)
WARM_START_TOOL_RATE = 0.3


def warm_start(out: Path, settings: Any) -> Path:
    """SFT of the calculator-skilled base on the quickstart's demonstrator (in this process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.tiny import shipped_skilled_model
    from agentrl.trainer.sft import tokenize_conversations
    from agentrl_benchmarks._sft import supervised
    from agentrl_data_prep.tasks import sft_conversations
    from agentrl_tools.calculator import CalculatorTool

    base = shipped_skilled_model("calculator")
    if base is None:
        raise RuntimeError("the calculator-skilled base does not ship with this checkout (agentrl/tiny_models)")
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    conversations = sft_conversations(TASK, WARM_START_DEMOS, seed=settings.seed + 17, tool_rate=WARM_START_TOOL_RATE)
    examples = tokenize_conversations(tokenizer, conversations, tools=[CalculatorTool.schema()], max_length=512)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    supervised(model, examples, pad_token_id=tokenizer.pad_token_id, batch_size=32, lr=3e-4, betas=(0.9, 0.98), epochs=1,
               seed=settings.seed)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def train_rows(settings: Any) -> list[dict[str, Any]]:
    from agentrl_data_prep.tasks import generate

    return generate(TASK, settings.prompts * settings.steps, seed=settings.seed, split="train")


def _turn_limits(settings: Any) -> list[str]:
    budget = settings.max_new_tokens
    return [f"rollout.max_new_tokens={budget}", f"data.max_response_length={budget}",
            f"agent.max_assistant_turns={TOOL_ROUNDS + 1}", "reward.default=gsm8k"]


def agentrl_overrides(train_file: Path, settings: Any) -> list[str]:
    """agentrl's side: the tool loop on the task's rows (the rows name the calculator)."""
    return ["data.task=null", f"data.train_files=[{train_file}]", "agent.default_loop=tool_agent", *_turn_limits(settings)]


def evaluate(policy: Path, work: Path, settings: Any) -> float:
    """Mean reward of the tool loop on held-out questions (``agentrl rollout``, T = 1, fixed seeds):
    ``settings.eval_prompts`` questions x ``settings.eval_samples`` samples."""
    from agentrl.agent.rollout_cli import cli_main
    from agentrl.data.io import write_rows
    from agentrl_data_prep.tasks import generate

    work.mkdir(parents=True, exist_ok=True)
    questions = write_rows(generate(TASK, settings.eval_prompts, seed=settings.seed, split="test"), work / "eval.parquet")
    code = cli_main([
        f"model.path={policy}", "data.task=null", f"data.train_files=[{questions}]", f"rollout.n={settings.eval_samples}",
        "rollout.temperature=1.0", f"trainer.seed={settings.seed}", *_turn_limits(settings),
        f"trainer.runs_root={work}", "trainer.run_name=eval", "logging.progress=false",
    ])
    if code != 0:
        raise RuntimeError(f"the evaluation of {policy} failed (agentrl rollout exited with {code})")
    return float(json.loads((work / "eval" / "summary.json").read_text())["reward_mean"])


def trl_parts(tokenizer: Any, settings: Any) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """TRL's side: (dataset rows, reward function, GRPOTrainer keyword arguments and GRPOConfig
    ones). The tokenizer gets TRL's Qwen3 response template (agentrl's template writes Qwen calls)."""
    from trl.chat_template_utils import qwen3_template

    from agentrl.rewards import gsm8k_strict
    from agentrl_tools.calculator import evaluate as arithmetic
    from agentrl_tools.calculator import format_number

    tokenizer.response_template = qwen3_template

    # The calculator plugin's arithmetic; the docstring and the argument's type give the schema TRL
    # renders, the same as the plugin's (no return annotation: TRL would add a "return" field).
    def calculator(expression: str):
        """
        Evaluate an arithmetic expression with + - * / // % ** and parentheses.

        Args:
            expression: the expression to evaluate, for example 4821 * 37
        """
        return format_number(arithmetic(expression))

    rows = [{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]} for row in train_rows(settings)]

    def correct(completions: list[Any], ground_truth: list[str], **_: Any) -> list[float]:
        # completions[i]: the messages after the prompt (calls, tool results, the answer)
        answers = [c[-1].get("content") or "" if c and c[-1]["role"] == "assistant" else "" for c in completions]
        return [float(gsm8k_strict("arith", text, truth)) for text, truth in zip(answers, ground_truth)]

    return rows, correct, {"tools": [calculator], "config": {"max_tool_calling_iterations": TOOL_ROUNDS}}

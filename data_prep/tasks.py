"""Tool tasks for tiny models, with deterministic train/test splits.

* ``arith``: multi-digit products and sums a tiny model cannot do in its head
  ("What is 4821 * 37?"), solved with one ``calculator`` call.
* ``word``: short word problems needing two or three calculator calls.
* ``arith_retry``: ``arith`` with the GSM8K-style interaction (told it is wrong, it may retry).
* ``word_steps``: the ``word`` problems with every calculator call checked on its own: a call
  reaching one of the problem's intermediate values earns ``STEP_REWARD`` on its turn.
* ``solver_verifier``: the ``arith`` problems played by a solver and a verifier of one policy
  (``data_prep/solver_verifier.py``, docs/roles.md).

Rows follow the standard schema (``agentrl.data.row.Row``), answers end with ``#### <number>``.
A problem belongs to the test split when a hash of its text says so (one in eight), so the
splits are disjoint whatever the seed and the sizes, and the same seed gives the same rows.

    python -m data_prep.tasks --task arith --n 1000 --seed 0 --output-dir data/arith
"""

from __future__ import annotations

import argparse
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["TASKS", "SYSTEM_PROMPT", "RECOVERY_SOURCE", "Problem", "generate", "validation_rows", "after_wrong_answer", "mental_slip", "calculator_turn", "sft_conversations", "write_parquet", "main"]

SYSTEM_PROMPT = "Use the calculator tool for arithmetic. End your answer with #### <number>."
TEST_FRACTION = 8  # one problem in eight is held out


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[tuple[str, int], ...]  # (calculator expression, its value), in order
    answer: int


def _arith(rng: random.Random) -> Problem:
    if rng.random() < 0.5:
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        expression, value = f"{a} * {b}", a * b
    else:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        expression, value = f"{a} + {b}", a + b
    return Problem(f"What is {expression}?", ((expression, value),), value)


_ITEMS = ["apples", "pencils", "books", "cards", "marbles", "stickers"]


def _word(rng: random.Random) -> Problem:
    item = rng.choice(_ITEMS)
    boxes, per_box = rng.randint(12, 99), rng.randint(12, 99)
    total = boxes * per_box
    if rng.random() < 0.5:
        given = rng.randint(10, total - 1)
        left = total - given
        question = f"Sam buys {boxes} boxes of {per_box} {item} and gives away {given}. How many {item} are left?"
        return Problem(question, ((f"{boxes} * {per_box}", total), (f"{total} - {given}", left)), left)
    price = rng.randint(2, 9)
    extra = rng.randint(10, 99)
    cost = total * price
    question = (
        f"Ana buys {boxes} boxes of {per_box} {item} at {price} dollars each {item[:-1]}, "
        f"and pays {extra} dollars for delivery. How much does she pay?"
    )
    steps = ((f"{boxes} * {per_box}", total), (f"{total} * {price}", cost), (f"{cost} + {extra}", cost + extra))
    return Problem(question, steps, cost + extra)


TASKS: dict[str, tuple[Callable[[random.Random], Problem], str]] = {
    "arith": (_arith, "agentrl/arith"),
    "word": (_word, "agentrl/word"),
    "arith_retry": (_arith, "agentrl/arith_retry"),
    "word_steps": (_word, "agentrl/word"),
    "solver_verifier": (_arith, "agentrl/solver_verifier"),
}
# tasks drawing the same problems as another (a variant that differs in its rows only)
SAME_PROBLEMS = {"word_steps": "word", "solver_verifier": "arith"}
STEP_REWARD = 0.5  # word_steps: the reward of a calculator call that reaches one of the problem's intermediate values


def _split_of(question: str) -> str:
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % TEST_FRACTION
    return "test" if bucket == 0 else "train"


def problems(task: str, n: int, seed: int, split: str) -> Iterator[Problem]:
    """``n`` distinct problems of ``split``, the same for the same (task, seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    make = TASKS[task][0]
    rng = random.Random(f"{SAME_PROBLEMS.get(task, task)}:{seed}")
    seen: set[str] = set()
    tries = 0
    while len(seen) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise RuntimeError(f"could not draw {n} distinct {split} problems for {task}")
        problem = make(rng)
        if problem.question in seen or _split_of(problem.question) != split:
            continue
        seen.add(problem.question)
        yield problem


def _row(task: str, problem: Problem, index: int, split: str) -> dict[str, Any]:
    data_source = TASKS[task][1]
    extra: dict[str, Any] = {
        "index": index,
        "split": split,
        "tools_kwargs": {"calculator": {"create_kwargs": {}}},
    }
    if task == "word_steps":
        extra["tools_kwargs"]["calculator"]["create_kwargs"] = {
            "expected_steps": [value for _, value in problem.steps], "step_reward": STEP_REWARD}
    if task == "arith_retry":
        extra["interaction_kwargs"] = {"name": "gsm8k", "query": problem.question, "ground_truth": str(problem.answer)}
    if task == "solver_verifier":  # which kind of answer the verifier checks, right or wrong in turn
        from agentrl_data_prep.solver_verifier import verifier_extra

        extra["verifier"] = verifier_extra(problem.question, problem.answer, index)
    return {
        "data_source": data_source,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": extra,
        "agent_name": "solver_verifier" if task == "solver_verifier" else "tool_agent",
    }


def generate(task: str, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """``n`` rows of ``task`` for ``split`` (plain dicts, valid ``Row``s)."""
    return [_row(task, p, i, split) for i, p in enumerate(problems(task, n, seed, split))]


RECOVERY_SOURCE = "agentrl/arith_retry_after_wrong"


def after_wrong_answer(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """``arith_retry`` rows that start one attempt later: the prompt holds a first answer from
    "mental arithmetic" (:func:`mental_slip`, as the warm start's demonstrator answers) and the
    interaction's "incorrect" reply, so what the policy writes first is its second attempt.
    Their data source is ``RECOVERY_SOURCE``: validated beside the plain rows, they measure how
    often a policy recovers after a wrong answer, on every problem and at every validation."""
    from agentrl_interactions.gsm8k import INCORRECT

    rng = random.Random(f"after_wrong:{seed}")
    out = []
    for row in rows:
        if "interaction_kwargs" not in row["extra_info"]:
            raise ValueError("after_wrong_answer needs rows with an interaction (task arith_retry)")
        answer = int(row["reward_model"]["ground_truth"])
        prompt = row["prompt"] + [{"role": "assistant", "content": f"#### {mental_slip(answer, rng)}"},
                                  {"role": "user", "content": INCORRECT}]
        out.append({**row, "data_source": RECOVERY_SOURCE, "prompt": prompt})
    return out


def validation_rows(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The held-out rows a job on ``task`` validates on: ``n`` problems of the test split, and for
    ``arith_retry`` the same problems again starting after a wrong first answer
    (:func:`after_wrong_answer`), so the recovery after feedback is measured on every problem."""
    rows = generate(task, n, seed, "test")
    return rows + after_wrong_answer(rows, seed) if task == "arith_retry" else rows


def mental_slip(answer: int, rng: random.Random) -> int:
    """``answer`` with one digit changed (never the leading one to 0): "mental arithmetic" that is
    close and wrong, as a tiny model's guess at a product of large numbers is."""
    digits = list(str(answer))
    position = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[position] and not (position == 0 and d == "0" and len(digits) > 1)]
    digits[position] = rng.choice(choices)
    return int("".join(digits))


def sft_conversations(
    task: str, n: int, seed: int = 0, split: str = "train", *, informal_rate: float = 0.0, tool_rate: float = 1.0,
    max_attempts: int = 3,
) -> list[list[dict[str, Any]]]:
    """Demonstrations: one calculator call per step, then the answer.

    ``tool_rate`` is the chance that an answer is worked out with the calculator; otherwise the
    demonstrator answers at once from "mental arithmetic", in the right format and wrong by one
    digit (:func:`mental_slip`). The quickstart's warm start uses a demonstrator who rarely uses
    the tool, so that RL has the tool to discover. ``informal_rate`` is the chance that an answer
    is written as prose ("The answer is N.") instead of the required ``#### N``, which the strict
    reward checks. For ``arith_retry`` an answer that the interaction judges wrong (prose or a
    slip) is followed by its "incorrect" feedback and another attempt (with the same chances), up
    to ``max_attempts`` answers. The draws are seeded by (task, seed, split).
    """
    if not 0.0 <= informal_rate <= 1.0:
        raise ValueError(f"informal_rate must be in [0, 1], got {informal_rate}")
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    from agentrl_interactions.gsm8k import INCORRECT

    if task == "solver_verifier":  # the two roles' demonstrations in turn
        from agentrl_data_prep.solver_verifier import demonstrations

        return demonstrations(n, seed, split, tool_rate=tool_rate, informal_rate=informal_rate)
    style = random.Random(f"demonstrator:{SAME_PROBLEMS.get(task, task)}:{seed}:{split}")
    conversations = []
    for problem in problems(task, n, seed, split):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
        ]
        attempts = max_attempts if task == "arith_retry" else 1
        computed = False  # the calculator's results are in the conversation
        for attempt in range(attempts):
            # the draws in a fixed order, so that tool_rate=1 gives the demonstrations it gave before it existed
            informal = style.random() < informal_rate
            if not computed and (tool_rate >= 1.0 or style.random() < tool_rate):
                computed = True
                for expression, value in problem.steps:
                    messages += calculator_turn(expression, value)
            answer = problem.answer if computed else mental_slip(problem.answer, style)
            messages.append({"role": "assistant", "content": f"The answer is {answer}." if informal else f"#### {answer}"})
            if (computed and not informal) or attempt == attempts - 1:
                break
            messages.append({"role": "user", "content": INCORRECT})
        conversations.append(messages)
    return conversations


def calculator_turn(expression: str, value: int) -> list[dict[str, Any]]:
    """A demonstration's calculator call on ``expression`` and the tool's answer, ``value``."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": str(value)}]


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    from agentrl.data.io import write_rows

    return write_rows(rows, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--n", type=int, default=1000, help="training rows (the test split gets n/8, at least 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(generate(args.task, args.n, args.seed, "train"), out / "train.parquet")
    test = validation_rows(args.task, max(32, args.n // TEST_FRACTION), args.seed)
    write_parquet(test, out / "test.parquet")
    print(f"wrote {args.n} train and {len(test)} test rows of {args.task} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

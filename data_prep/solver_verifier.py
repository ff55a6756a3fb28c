"""``solver_verifier``: the ``arith`` problems played by two roles of one policy (docs/roles.md).

Rows are ``arith`` rows run by the ``solver_verifier`` loop (agent_loops/solver_verifier.py):
the solver answers with the calculator, the verifier judges an answer to the same question.
Each row says which kind of answer its verifier checks (``extra_info.verifier``, ``checks_right``:
every other row a right one, the others a wrong one) and holds a wrong answer to supply
(``wrong_answer``, one digit off, as a "mental" answer is): the verifier checks the solver's
answer when it is of the row's kind, else the loop supplies one that is (the ground truth or
``wrong_answer``). So the verifier's answers are right and wrong in equal shares, in training
and held out, whatever the solver's skill: a verdict that ignores the answer (a base rate) is
right half the time, and only checking does better.

The warm start's demonstrations (``demonstrations``) hold both roles, three solvers to one
verifier: a solver as ``arith``'s demonstrator (the calculator at ``tool_rate``, else a "mental"
answer one digit wrong) and a verifier, on answers right or one digit wrong in equal shares,
that checks at ``CHECK_FACTOR`` times ``tool_rate`` and otherwise guesses its verdict (``#### 0``,
right, or ``#### 1``, wrong). It sees the question as the solver does, checks with one calculator
call for how far the answer is off, the question's expression minus the answer (``check_call``),
and answers ``#### <that difference>``: what the solver does with a calculator's result, so the
two roles share their skill. RL then has, for each role, the tool to discover.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["CHECK_FACTOR", "DATA_SOURCE", "check_call", "demonstrations", "verifier_extra", "verifier_messages"]

DATA_SOURCE = "agentrl/solver_verifier"
VERIFIER_EVERY = 4  # one demonstration in four is the verifier's
CHECK_FACTOR = 3.0  # the verifier's demonstrations check at this many times sft.tool_rate (at most always)


def verifier_extra(question: str, answer: int, index: int) -> dict[str, Any]:
    """The row's ``extra_info.verifier``: which kind of answer its verifier checks (right on even
    ``index``, wrong on odd) and the wrong answer to supply, drawn from the question."""
    from agentrl_data_prep.tasks import mental_slip

    return {"checks_right": index % 2 == 0, "wrong_answer": mental_slip(answer, random.Random(f"wrong:{question}"))}


def verifier_messages(question: str, answer_text: str) -> list[dict[str, Any]]:
    """What the verifier sees: its instructions, the question, and the answer it checks."""
    from agentrl_agent_loops.solver_verifier import VERIFIER_PROMPT

    return [{"role": "system", "content": VERIFIER_PROMPT}, {"role": "user", "content": question},
            {"role": "user", "content": f"Answer: {answer_text}"}]


def check_call(expression: str, shown: int) -> dict[str, Any]:
    """The verifier's check of answer ``shown`` to ``expression``: a calculator call for how far it
    is off, ``expression`` minus ``shown`` (0: right)."""
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{expression} - {shown}"}}}


def demonstrations(n: int, seed: int, split: str, *, tool_rate: float, informal_rate: float) -> list[list[dict[str, Any]]]:
    """``n`` conversations over ``arith``'s problems, every fourth a verifier's, the others a solver's."""
    from agentrl_data_prep.tasks import mental_slip, problems, sft_conversations

    solver = iter(sft_conversations("arith", n - n // VERIFIER_EVERY, seed, split, informal_rate=informal_rate,
                                    tool_rate=tool_rate))
    style = random.Random(f"verifier:{seed}:{split}")
    check_rate = min(1.0, CHECK_FACTOR * tool_rate)
    out: list[list[dict[str, Any]]] = []
    for k, problem in enumerate(problems("arith", n, seed, split)):
        if k % VERIFIER_EVERY != VERIFIER_EVERY - 1:
            out.append(next(solver))
            continue
        right = style.random() < 0.5
        shown = problem.answer if right else mental_slip(problem.answer, style)
        messages = verifier_messages(problem.question, f"#### {shown}")
        if style.random() < check_rate:
            (expression, value), = problem.steps
            messages += [{"role": "assistant", "content": "", "tool_calls": [check_call(expression, shown)]},
                         {"role": "tool", "content": str(value - shown)}]
            verdict = f"#### {value - shown}"  # the check's result, as the solver writes one
        else:  # a guess: right (off by 0) or wrong
            verdict = "#### 0" if style.random() < 0.5 else "#### 1"
        messages.append({"role": "assistant", "content": verdict})
        out.append(messages)
    return out

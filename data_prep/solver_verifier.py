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

The warm start's demonstrations (``demonstrations``) hold both roles in equal shares: a solver
as ``arith``'s demonstrator (the calculator at ``tool_rate``, else a "mental" answer one digit
wrong) and a verifier, on answers right (``RIGHT_SHARE``) or one digit wrong, that first works the
question out as the solver does (the same messages; the calculator at ``CHECK_FACTOR`` times
``tool_rate``, else a "mental" answer), is told the answer (``told_answer``) and checks it with the
calculator: ``<its own answer> - <the told answer>``, whose result is its verdict (``#### 0``: the
told answer is its own). The check is a skill of the base (``model.tiny.skills=checking``); RL then
has, for each role, the tool to discover for the working: a verifier that worked the question out
with the calculator judges by the truth.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["CHECK_FACTOR", "DATA_SOURCE", "RIGHT_SHARE", "demonstrations", "verifier_demonstration", "verifier_extra"]

DATA_SOURCE = "agentrl/solver_verifier"
VERIFIER_EVERY = 2  # one demonstration in two is the verifier's
CHECK_FACTOR = 3.0  # the verifier's own working uses the calculator at this many times sft.tool_rate (at most always)
# the share of the verifier's demonstrations told a right answer: with right and wrong in equal
# shares, a check that copies one number twice (`<own> - <own>`) reproduced half of them and the
# checking base learned that; the rows the verifier is rewarded on stay balanced (verifier_extra)
RIGHT_SHARE = 0.25


def verifier_extra(question: str, answer: int, index: int) -> dict[str, Any]:
    """The row's ``extra_info.verifier``: which kind of answer its verifier checks (right on even
    ``index``, wrong on odd) and the wrong answer to supply, drawn from the question."""
    from agentrl_data_prep.tasks import mental_slip

    return {"checks_right": index % 2 == 0, "wrong_answer": mental_slip(answer, random.Random(f"wrong:{question}"))}


def verifier_demonstration(question: str, expression: str, value: int, *, computed: bool, own: int, shown: int) -> list[dict[str, Any]]:
    """A verifier's demonstration: the question as the solver's, its own working (the calculator
    on ``expression`` when ``computed``, then ``#### <own>``), the answer ``shown`` told, and its
    check with the calculator, ``<own> - <shown>``, whose result is its verdict (0: right)."""
    from agentrl_agent_loops.solver_verifier import told_answer
    from agentrl_data_prep.tasks import SYSTEM_PROMPT, calculator_turn

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    if computed:
        messages += calculator_turn(expression, value)
    return messages + [{"role": "assistant", "content": f"#### {own}"}, told_answer(f"#### {shown}"),
                       *calculator_turn(f"{own} - {shown}", own - shown), {"role": "assistant", "content": f"#### {own - shown}"}]


def demonstrations(n: int, seed: int, split: str, *, tool_rate: float, informal_rate: float) -> list[list[dict[str, Any]]]:
    """``n`` conversations over ``arith``'s problems, every other a verifier's, the others a solver's."""
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
        (expression, value), = problem.steps
        shown = problem.answer if style.random() < RIGHT_SHARE else mental_slip(problem.answer, style)
        computed = style.random() < check_rate
        own = value if computed else mental_slip(value, style)
        out.append(verifier_demonstration(problem.question, expression, value, computed=computed, own=own, shown=shown))
    return out

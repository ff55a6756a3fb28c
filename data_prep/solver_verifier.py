"""``solver_verifier``: the ``arith`` problems played by two roles of one policy (docs/roles.md).

Rows are ``arith`` rows run by the ``solver_verifier`` loop (agent_loops/solver_verifier.py):
the solver answers with the calculator, the verifier judges the solver's answer. The warm start's
demonstrations (``demonstrations``) hold both roles, three solvers to one verifier (the solver's
skills are the harder to keep): a solver as ``arith``'s demonstrator
(the calculator at ``tool_rate``, else a "mental" answer one digit wrong) and a verifier that
checks with the calculator at ``tool_rate`` and otherwise guesses its verdict, on answers right
or one digit wrong in equal shares. RL then has, for each role, the tool to discover.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["DATA_SOURCE", "demonstrations", "verifier_messages"]

DATA_SOURCE = "agentrl/solver_verifier"
VERIFIER_EVERY = 4  # one demonstration in four is the verifier's


def verifier_messages(question: str, answer_text: str) -> list[dict[str, Any]]:
    """What the verifier sees: its instructions, the question, and the solver's answer."""
    from agentrl_agent_loops.solver_verifier import VERIFIER_PROMPT

    return [{"role": "system", "content": VERIFIER_PROMPT}, {"role": "user", "content": f"Question: {question}"},
            {"role": "user", "content": f"Answer: {answer_text}"}]


def demonstrations(n: int, seed: int, split: str, *, tool_rate: float, informal_rate: float) -> list[list[dict[str, Any]]]:
    """``n`` conversations over ``arith``'s problems, every fourth a verifier's, the others a solver's."""
    from agentrl_data_prep.tasks import mental_slip, problems, sft_conversations

    solver = iter(sft_conversations("arith", n - n // VERIFIER_EVERY, seed, split, informal_rate=informal_rate,
                                    tool_rate=tool_rate))
    style = random.Random(f"verifier:{seed}:{split}")
    out: list[list[dict[str, Any]]] = []
    for k, problem in enumerate(problems("arith", n, seed, split)):
        if k % VERIFIER_EVERY != VERIFIER_EVERY - 1:
            out.append(next(solver))
            continue
        right = style.random() < 0.5
        shown = problem.answer if right else mental_slip(problem.answer, style)
        messages = verifier_messages(problem.question, f"#### {shown}")
        if style.random() < tool_rate:
            (expression, value), = problem.steps
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": str(value)}]
            verdict = right
        else:
            verdict = style.random() < 0.5  # a guess
        messages.append({"role": "assistant", "content": f"#### {int(verdict)}"})
        out.append(messages)
    return out

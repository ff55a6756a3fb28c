"""``solver_verifier``: two roles of one policy, a solver and a verifier (docs/roles.md).

The solver answers the row's question as ``tool_agent`` does (calculator calls, then an answer
ending ``#### <number>``). The verifier first works the question out exactly as the solver does,
from the same messages (so the one policy's calculator skill, which copies the question's
expression into its call, serves both roles alike), then is told an answer to check and gives its
verdict: ``#### 0`` if the answer is the one it worked out (right), any other integer if not; its
demonstrations check with the calculator (``<own> - <told>``, whose result is the verdict, a skill
of the ``checking`` base), and a verdict said at once counts as well. The answer it checks is the
solver's when that is of the kind the row asks for (``extra_info.verifier.checks_right``), else one
the loop supplies (the ground truth or ``extra_info.verifier.wrong_answer``), so a row's verifier
checks a right answer or a wrong one whatever the solver said (``data_prep/solver_verifier.py``); a
row without ``verifier`` has its verifier check the solver's answer. Rewards by role: the solver
1.0 for a right answer (the GSM8K rule against the row's ground truth), the verifier 1.0 for a
right verdict on the answer it checked; 0.0 otherwise.

Both roles are ``shared`` (trained by one policy, each compared with its own role's samples).
With ``agent.roles.verifier=frozen`` a scripted verifier judges by the rule instead, and only the
solver trains (a solver with a scripted judge).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentrl.agent.roles import RolePolicy, RolesEpisode, RolesLoop
from agentrl.data.row import Row
from agentrl.rewards import gsm8k_strict
from agentrl.trajectory import TrajectoryFinish

__all__ = ["SolverVerifierLoop", "checked_answer", "told_answer", "verdict_of"]

_VERDICT = re.compile(r"####\s*(-?\d+)\s*$")
_TOLD = re.compile(r"####\s*(\S+)$")


def verdict_of(text: str) -> bool | None:
    """The verdict of a verifier's answer ending ``#### <integer>``: True (right) for 0, False
    (wrong) for any other; None: no verdict."""
    found = _VERDICT.search(text.strip())
    return None if found is None else int(found.group(1)) == 0


def told_answer(answer: str) -> dict[str, Any]:
    """The message that tells the verifier, after its own working, the answer it checks: its final
    number alone (``Answer: 408`` for ``#### 408``; an answer without ``####`` as it is). Its own
    answer ends ``#### <number>``, so the two numbers its check copies (``<own> - <told>``) follow
    different words; told as ``Answer: #### 408`` the checking base copied the nearer one twice."""
    found = _TOLD.search(answer.strip())
    return {"role": "user", "content": f"Answer: {found.group(1) if found else answer}"}


def checked_answer(row: Row, answer: str, right: bool) -> tuple[str, bool]:
    """The answer the verifier checks and whether it is right: the solver's ``answer`` (right or
    not, ``right``) when it is of the kind the row asks for (``extra_info.verifier``), else the
    ground truth or the row's wrong answer; the solver's when the row asks for none."""
    wanted = getattr(row.extra_info, "verifier", None)
    if wanted is not None and not (isinstance(wanted, Mapping) and {"checks_right", "wrong_answer"} <= wanted.keys()):
        raise ValueError(f"extra_info.verifier must hold checks_right and wrong_answer, got {wanted!r}")
    if wanted is None or bool(wanted["checks_right"]) == right:
        return answer, right
    if wanted["checks_right"]:
        return f"#### {row.ground_truth}", True
    return f"#### {wanted['wrong_answer']}", False


class SolverVerifierLoop(RolesLoop):
    name = "solver_verifier"
    roles: dict[str, RolePolicy] = {"solver": "shared", "verifier": "shared"}

    def role_messages(self, role: str, row: Row, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # both roles start from the row's messages, token for token: the tiny policy copies the
        # question's expression into its call only where the question sits as in its training
        # (an extra message or a longer system prompt before it, and it miscopies: docs/roles.md)
        return row.messages()

    def shown(self, viewer: str, speaker: str, text: str) -> dict[str, Any] | None:
        # the loop tells the verifier the answer it checks (checked_answer); the solver never sees
        # the verdict (it is scored before)
        return None

    async def play_roles(self, game: RolesEpisode) -> TrajectoryFinish:
        truth = str(game.row.ground_truth)
        game.rewards.update(solver=0.0, verifier=0.0)  # what a role ended by a limit before its answer gets
        answer = await self._answer(game, "solver")
        right = gsm8k_strict(game.row.data_source, answer, truth) == 1.0
        game.rewards["solver"] = 1.0 if right else 0.0
        checked, checked_right = checked_answer(game.row, answer, right)
        if game.is_sampled("verifier"):
            await self._answer(game, "verifier")  # its own working, as the solver's
            game.tell("verifier", told_answer(checked))
            verdict = verdict_of(await self._answer(game, "verifier"))
        else:  # the scripted judge
            verdict = checked_right
            game.say("verifier", "#### 0" if checked_right else "#### 1")
        game.rewards["verifier"] = 1.0 if verdict == checked_right else 0.0
        return TrajectoryFinish.STOP

    async def _answer(self, game: RolesEpisode, role: str) -> str:
        """The role's turns until one without tool calls (its answer, said to the other role)."""
        ep = game.episode(role)
        while True:
            step = await game.turn(role)
            if not step.parsed.calls:
                return step.parsed.content
            outcomes = await ep.call_tools(step.index, step.parsed)
            ep.observe([o.call.result_message(ep.truncate_tool_text(o.text)) for o in outcomes], "tool")

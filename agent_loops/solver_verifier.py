"""``solver_verifier``: two roles of one policy, a solver and a verifier (docs/roles.md).

The solver answers the row's question as ``tool_agent`` does (calculator calls, then an answer
ending ``#### <number>``). The verifier sees the question and the solver's answer and gives a
verdict as a number, ``#### 1`` (right) or ``#### 0`` (wrong): the tiny model writes
``#### <number>`` best (it may call the calculator too). Rewards by role:
the solver 1.0 for a right answer (the GSM8K rule against the row's ground truth), the verifier
1.0 for a right verdict on that answer; 0.0 otherwise.

Both roles are ``shared`` (trained by one policy, each compared with its own role's samples).
With ``agent.roles.verifier=frozen`` a scripted verifier judges by the rule instead, and only the
solver trains (a solver with a scripted judge).
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.agent.roles import RolePolicy, RolesEpisode, RolesLoop
from agentrl.data.row import Row
from agentrl.rewards import gsm8k_strict
from agentrl.trajectory import TrajectoryFinish

__all__ = ["SolverVerifierLoop", "VERIFIER_PROMPT", "verdict_of"]

VERIFIER_PROMPT = ("Check the answer to the question. Use the calculator tool for arithmetic. "
                   "End with #### 1 if the answer is right, #### 0 if it is wrong.")
_VERDICT = re.compile(r"####\s*([01])\s*$")


def verdict_of(text: str) -> bool | None:
    """The verdict of a verifier's answer ending ``#### 1`` (True: right) or ``#### 0`` (False:
    wrong); None: no verdict."""
    found = _VERDICT.search(text.strip())
    return None if found is None else found.group(1) == "1"


class SolverVerifierLoop(RolesLoop):
    name = "solver_verifier"
    roles: dict[str, RolePolicy] = {"solver": "shared", "verifier": "shared"}

    def role_messages(self, role: str, row: Row, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if role == "solver":
            return row.messages()
        question = next((m["content"] for m in reversed(row.messages()) if m["role"] == "user"), "")
        return [{"role": "system", "content": VERIFIER_PROMPT}, {"role": "user", "content": f"Question: {question}"}]

    def shown(self, viewer: str, speaker: str, text: str) -> dict[str, Any] | None:
        # the verifier reads the solver's answer; the solver never sees the verdict (it is scored before)
        return {"role": "user", "content": f"Answer: {text}"} if viewer == "verifier" else None

    async def play_roles(self, game: RolesEpisode) -> TrajectoryFinish:
        truth = str(game.row.ground_truth)
        game.rewards.update(solver=0.0, verifier=0.0)  # what a role ended by a limit before its answer gets
        answer = await self._answer(game, "solver")
        right = gsm8k_strict(game.row.data_source, answer, truth) == 1.0
        game.rewards["solver"] = 1.0 if right else 0.0
        if game.is_sampled("verifier"):
            verdict = verdict_of(await self._answer(game, "verifier"))
        else:  # the scripted judge
            verdict = right
            game.say("verifier", f"#### {int(right)}")
        game.rewards["verifier"] = 1.0 if verdict == right else 0.0
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

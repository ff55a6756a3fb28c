"""Roles through the OpenAI endpoint: an agent program with several agents (docs/roles.md).

With ``agent.roles`` set, the ``openai_agent`` loop gives its program one ``base_url`` whose
requests name their role in the ``model`` field (what every OpenAI client and agent framework
sets per agent: ``client.chat.completions.create(model="solver", ...)``). Each role has an
``EndpointSession`` of its own: its own segments (exact token streams), limits, counters, engine
session and seed, so each role's calls become that role's trajectory, in its own group
``<group>@<role>`` (``agentrl.agent.roles``). A request whose ``model`` names no role is refused
(400, ``param: model``); so is one naming a ``frozen`` role (the program speaks for it itself).
A ``trained`` role's session samples from the role's own policy (``EndpointSession.policy``).
What the other agents said reaches a role's context as the program puts it in that role's
messages (user messages, typically).

Rewards by role: ``AgentResult.reward`` as a mapping by role, else the reward function on the
final answer (a mapping keyed by role names gives each role its own; anything else goes to every
role).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentrl.agent.loop import LoopContext
from agentrl.agent.openai_endpoint import EndpointSession
from agentrl.agent.openai_wire import RequestRefused
from agentrl.agent.program import AgentResult
from agentrl.agent.roles import role_group_id, role_policies
from agentrl.data.row import Row
from agentrl.rewards import score_to_float
from agentrl.trajectory import Trajectory, TrajectoryFinish

if TYPE_CHECKING:
    import asyncio

    from agentrl.agent.setup import Limits

__all__ = ["RoleSessions"]


class RoleSessions:
    """One trajectory's endpoint session for a program with roles: a session per role, chosen by
    each request's ``model``; the endpoint serves it as it serves an ``EndpointSession``."""

    def __init__(self, sessions: Mapping[str, EndpointSession], frozen: set[str], limits: "Limits"):
        self.sessions = dict(sessions)
        self.frozen = frozen
        self.limits = limits
        self.loop: asyncio.AbstractEventLoop | None = None
        self.refused: str | None = None  # set by the endpoint, as on an EndpointSession
        self.crashed: str | None = None
        self.last: EndpointSession | None = None  # the session of the last request served

    @classmethod
    def for_trajectory(cls, ctx: LoopContext, loop_name: str, *, row_id: str, sample_index: int,
                       seed: int | None) -> "RoleSessions":
        policies = role_policies({name: "shared" for name in ctx.roles}, ctx.roles, loop=loop_name)
        sessions = {}
        for name, policy in policies.items():
            if policy != "frozen":
                role_seed = None if seed is None else (seed + zlib.crc32(name.encode())) & 0x7FFFFFFF
                session = EndpointSession.for_trajectory(ctx, loop_name, row_id=row_id, sample_index=sample_index, seed=role_seed)
                session.session_id = f"{row_id}#{sample_index}@{name}"
                if policy == "trained":
                    session.policy = name  # sampled by the role's own policy
                sessions[name] = session
        return cls(sessions, {name for name, policy in policies.items() if policy == "frozen"}, ctx.limits)

    def _role(self, body: dict[str, Any]) -> EndpointSession:
        role = body.get("model")
        if role in self.frozen:
            raise RequestRefused(f"model: role {role!r} is frozen: the program speaks for it, the policy does not",
                                 param="model")
        if role not in self.sessions:
            raise RequestRefused(f"model: {role!r} names no role of this episode (roles: {', '.join(self.sessions)})",
                                 param="model")
        return self.sessions[role]

    async def complete(self, body: dict[str, Any], *, with_tokens: bool = False) -> dict[str, Any]:
        session = self._role(body)
        session.loop, self.last = self.loop, session
        response = await session.complete(body, with_tokens=with_tokens)
        response["model"] = body["model"]  # the role answered, as a server names the model it served
        return response

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._role(body).tokenize(body)

    # what the openai_agent loop reads of a session when the program ends
    @property
    def finish(self) -> TrajectoryFinish | None:
        return next((s.finish for s in self.sessions.values() if s.finish is not None), None)

    @property
    def error(self) -> str | None:
        return next((s.error for s in self.sessions.values() if s.error is not None), None)

    @property
    def calls(self) -> list[Any]:
        return self.last.calls if self.last is not None else []

    def trajectories(self, loop: Any, row: Row, ctx: LoopContext, result: Any, finish: TrajectoryFinish, error: str | None,
                     *, row_id: str, group_id: str, sample_index: int) -> list[Trajectory]:
        """One trajectory per role (``OpenAIAgentLoop._trajectory`` of its session), rewarded by role."""
        answer = result if isinstance(result, AgentResult) else AgentResult(final_answer="" if result is None else str(result))
        rewards = self._rewards(answer, row, ctx, finish)
        out = []
        for name, session in self.sessions.items():
            own = AgentResult(final_answer=answer.final_answer, reward=rewards.get(name), metrics=answer.metrics)
            t = loop._trajectory(row, ctx, session, own, finish, error, row_id=row_id, group_id=group_id,
                                 sample_index=sample_index)
            out.append(dataclasses.replace(t, role=name, group_id=role_group_id(group_id, name)))
        return out

    def _rewards(self, answer: AgentResult, row: Row, ctx: LoopContext, finish: TrajectoryFinish) -> dict[str, float]:
        """Each role's reward: the program's (a mapping by role, or one number for all), else the
        reward function's; none (the loop's own rules) for an episode that failed."""
        given: Any = answer.reward
        if given is None:
            fn = ctx.reward_fn(row.data_source)
            if fn is None or finish in (TrajectoryFinish.LOOP_ERROR, TrajectoryFinish.PROGRAM_ERROR):
                return {}
            given = fn(row.data_source, answer.final_answer, row.ground_truth, row.extra_info.model_dump())
        if isinstance(given, Mapping) and given and set(given) <= set(self.sessions) | self.frozen:
            return {role: score_to_float(given[role])[0] if role in given else 0.0 for role in self.sessions}
        score = score_to_float(given)[0]
        return {role: score for role in self.sessions}

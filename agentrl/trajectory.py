"""The trajectory: one multi-turn episode as an exact token stream.

Every response token knows where it came from: *sampled* by the engine (mask 1, with the
engine's logprob) or *observed* (tool responses, interaction and user turns rendered through
the chat template: mask 0, logprob 0.0). ``TrajectoryBuilder`` is the only way tokens are
appended, and it keeps ``response_ids``, ``response_mask`` and ``logprobs`` the same length.

Turns are disjoint spans; tokens outside every turn are template glue (masked).

Turn rewards (a tool's step reward, an interaction's turn score) are stored on the assistant
turn they judge, with that turn's token span, so the trainer can place them on its last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Sequence

from agentrl.errors import TrajectoryError

__all__ = ["Turn", "ToolCallRecord", "TrajectorySegment", "Trajectory", "TrajectoryBuilder", "TrajectoryFinish", "TurnRole",
           "NO_VERSION"]

NO_VERSION = -1  # the token_versions entry of a token the model did not sample (or of unknown version)

TurnRole = Literal["assistant", "tool", "user"]


class TrajectoryFinish(str, Enum):
    """Why an episode ended: ``Trajectory.finish_reason``, stored as its string value and
    counted in the ``finish/<value>`` metrics. Not to be confused with
    ``agentrl.engines.base.FinishReason``, why one *generate call* stopped (stop, length,
    abort); the loops turn the engine's ``length`` and ``abort`` into the members of the same
    value below.

    * ``stop``: the loop finished normally (the model answered; react: a final answer or an
      end-of-turn token).
    * ``length``: the engine stopped a turn at ``rollout.max_new_tokens``.
    * ``max_assistant_turns``: ``agent.max_assistant_turns`` used up, and the loop wanted another
      assistant turn or an observation that only a further turn could read (tool calls of the
      last turn are then not executed: metric ``tool_calls_unexecuted``).
    * ``max_user_turns``: the interaction answered, but ``agent.max_user_turns`` were used up.
    * ``response_budget``: ``data.max_response_length`` (the whole response, sampled and
      observed) leaves no room for the next turn or observation.
    * ``trajectory_timeout``: ``agent.trajectory_timeout_s`` elapsed.
    * ``malformed_tool_call``: a call could not be understood and
      ``agent.malformed_call_policy`` is ``end``.
    * ``interaction_done``: the interaction said the episode is over.
    * ``interaction_error``: the interaction raised (start, respond or calculate_score); the
      error is in ``reward_info["error"]``.
    * ``engine_error``: the engine failed a request after its retries; error in ``reward_info``.
    * ``abort``: the engine aborted a request (e.g. the server went away or was asked to stop).
    * ``loop_error``: the loop itself raised; the trajectory is empty, the error is in
      ``reward_info``, and the trainer drops it (``RolloutRunner``). For an agent program
      (``openai_agent``): the endpoint crashed or refused a request, the program's call failed
      in transport (connection, timeout, a 5xx), or the program raised ``ImportError`` (a
      package it needs is not installed: a setup problem, not the model's output).
    * ``program_error``: an agent program raised while the endpoint and the engine were healthy
      (a framework that gave up on the model's output): a scored episode, rewarded
      ``agent.program_error_reward`` and kept in the loss; the exception's type is in
      ``reward_info["exception_type"]`` and counted in ``program_errors/<type>``.
    * ``environment_error``: the environment the row belongs to (``agentrl.environments``: an
      OpenEnv server, a verifiers or TRL environment) failed: its server died or did not answer
      in time, or its own code raised. An infrastructure failure like ``engine_error``: kept,
      counted in ``failures/environment_error``, left out of the loss; error in ``reward_info``.
    """

    STOP = "stop"
    LENGTH = "length"
    MAX_ASSISTANT_TURNS = "max_assistant_turns"
    MAX_USER_TURNS = "max_user_turns"
    RESPONSE_BUDGET = "response_budget"
    TRAJECTORY_TIMEOUT = "trajectory_timeout"
    MALFORMED_TOOL_CALL = "malformed_tool_call"
    INTERACTION_DONE = "interaction_done"
    INTERACTION_ERROR = "interaction_error"
    ENGINE_ERROR = "engine_error"
    ABORT = "abort"
    LOOP_ERROR = "loop_error"
    PROGRAM_ERROR = "program_error"
    ENVIRONMENT_ERROR = "environment_error"

    def __str__(self) -> str:  # the value, in f-strings and metric names too (as enum.StrEnum)
        return self.value

    @classmethod
    def parse(cls, value: str, *, where: str = "finish_reason") -> "TrajectoryFinish":
        """The member with this value; an unknown value is a ``TrajectoryError`` naming ``where``."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise TrajectoryError(f"{where}: unknown finish reason {value!r} (known: {known})") from None


@dataclass(slots=True)
class Turn:
    """A span ``[start, end)`` of response tokens produced by one role."""

    role: TurnRole
    start: int
    end: int
    reward: float | None = None  # only on assistant turns: the turn reward that judges them

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class ToolCallRecord:
    """One tool call as the model wrote it and as it was executed."""

    turn: int  # index into Trajectory.turns of the assistant turn that made the call
    name: str | None  # None when the call could not be parsed
    arguments: dict[str, Any] | None
    raw: str  # the text of the call as generated
    result: str  # what the model was shown
    error: str | None = None  # error kind: bad_json | unknown_tool | invalid_arguments | tool_exception | timeout
    reward: float | None = None
    duration_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # the tool's ToolResult.metrics for this call


@dataclass(slots=True)
class TrajectorySegment:
    """An earlier stretch of an episode whose context was rewritten before it went on (an agent
    program that truncated or summarised its history: ``openai_agent``). Its tokens are exact as
    sampled, under its own prompt; the trainer trains them with the trajectory's advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    turns: list[Turn] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # as Trajectory.token_versions


@dataclass(slots=True)
class Trajectory:
    """A finished episode. ``response_*`` lists are aligned token for token."""

    row_id: str  # stable id of the dataset row (uid), shared by the n samples of a row
    group_id: str  # GRPO/RLOO group: the n samples of one row in one step
    sample_index: int
    data_source: str
    agent_name: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    turns: list[Turn]
    messages: list[dict[str, Any]]
    finish_reason: TrajectoryFinish  # a plain string is converted (and checked) on construction
    reward: float = 0.0  # trajectory reward
    reward_info: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0
    ground_truth: str | None = None
    # the segments before the last rewrite of the context, oldest first (the fields above hold
    # the last one); empty for every loop that never rewrites its context
    earlier_segments: list[TrajectorySegment] = field(default_factory=list)
    # the engine weight version that sampled each response token (NO_VERSION for tokens the model
    # did not sample); empty when unknown (stores written before schema version 5)
    token_versions: list[int] = field(default_factory=list)
    # the episode role whose turns these are (agentrl.agent.roles: its own tokens, its own group
    # ``<group>@<role>``); None for a single-agent episode (and stores before schema version 7)
    role: str | None = None

    def __post_init__(self) -> None:
        self.finish_reason = TrajectoryFinish.parse(self.finish_reason, where=f"trajectory {self.row_id}: finish_reason")
        for where, part in [("", self)] + [(f" earlier segment {k}", s) for k, s in enumerate(self.earlier_segments)]:
            n = len(part.response_ids)
            if len(part.response_mask) != n or len(part.logprobs) != n:
                raise TrajectoryError(
                    f"trajectory {self.row_id}{where}: response_ids ({n}), response_mask ({len(part.response_mask)}) "
                    f"and logprobs ({len(part.logprobs)}) must have equal lengths"
                )
            if part.token_versions and len(part.token_versions) != n:
                raise TrajectoryError(
                    f"trajectory {self.row_id}{where}: response_ids ({n}) and token_versions "
                    f"({len(part.token_versions)}) must have equal lengths"
                )

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version among the sampled tokens of every segment; from the
        ``weight_version_min`` metric when no token has a version (a trajectory of a store before
        schema version 5); None when neither says."""
        parts: list[TrajectorySegment | Trajectory] = [*self.earlier_segments, self]
        found = [v for part in parts for v, m in zip(part.token_versions, part.response_mask) if m and v != NO_VERSION]
        if found:
            return min(found)
        return int(self.metrics["weight_version_min"]) if "weight_version_min" in self.metrics else None

    @property
    def num_assistant_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == "assistant")


class TrajectoryBuilder:
    """Appends tokens turn by turn and keeps ids, mask, logprobs and token versions aligned."""

    __slots__ = ("prompt_ids", "response_ids", "response_mask", "logprobs", "turns", "token_versions")

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.token_versions: list[int] = []  # the weight version of each sampled token, NO_VERSION elsewhere

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def all_ids(self) -> list[int]:
        """The full context the engine sees next: prompt followed by the response so far."""
        return self.prompt_ids + self.response_ids

    def append_sampled(
        self, ids: list[int], logprobs: list[float], *, extend: bool = False, versions: Sequence[int] | None = None
    ) -> Turn:
        """Append tokens the engine sampled: trainable, with their logprobs and the weight version
        that sampled each (``GenerateResult.token_versions()``; None: unknown, NO_VERSION). With
        ``extend``, they continue the last turn when it is an assistant turn (a turn sampled in pieces)."""
        if len(ids) != len(logprobs):
            raise TrajectoryError(f"sampled ids ({len(ids)}) and logprobs ({len(logprobs)}) differ in length")
        if versions is not None and len(versions) != len(ids):
            raise TrajectoryError(f"sampled ids ({len(ids)}) and versions ({len(versions)}) differ in length")
        token_versions = [NO_VERSION] * len(ids) if versions is None else [int(v) for v in versions]
        last = self.turns[-1] if self.turns else None
        if extend and last is not None and last.role == "assistant" and last.end == len(self.response_ids):
            self.response_ids.extend(ids)
            self.response_mask.extend([1] * len(ids))
            self.logprobs.extend(logprobs)
            self.token_versions.extend(token_versions)
            last.end = len(self.response_ids)
            return last
        return self._append(ids, 1, list(logprobs), "assistant", token_versions)

    def append_observed(self, ids: list[int], role: TurnRole) -> Turn:
        """Append tokens the model did not choose (tool results, user turns): masked out."""
        if role == "assistant":
            raise TrajectoryError("observed tokens cannot form an assistant turn; use append_sampled")
        return self._append(ids, 0, [0.0] * len(ids), role)

    def append_template(self, ids: list[int]) -> None:
        """Append masked template glue that belongs to no turn (e.g. the separator a chat
        template writes after the final end-of-turn token)."""
        self.response_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.token_versions.extend([NO_VERSION] * len(ids))

    def _append(
        self, ids: list[int], mask: int, logprobs: list[float], role: TurnRole, versions: list[int] | None = None
    ) -> Turn:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.response_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs)
        self.token_versions.extend(versions if versions is not None else [NO_VERSION] * len(ids))
        turn = Turn(role=role, start=start, end=len(self.response_ids))
        self.turns.append(turn)
        return turn

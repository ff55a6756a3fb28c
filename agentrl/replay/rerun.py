"""Re-run stored trajectories through their agent loops, and say where observations differ.

``ReplayEngine`` answers each trajectory (``session_id`` = ``"<row_id>#<sample_index>"``) with
its stored assistant turns, in order, with their stored logprobs: no model runs. The loop, the
tools and the interactions run again for real, so a re-run trajectory equals the stored one
token for token exactly when everything outside the policy behaves as it did: a tool that is
not deterministic, a changed tool or interaction plugin, a changed chat template or changed
limits all show up as differences, each named by turn.

Serving follows the request as an engine would: tokens up to the first of the request's stop
tokens, at most ``max_new_tokens`` (finish reason ``length``); the rest of a cut turn is served
by the next call (loops that sample a turn in pieces, like ReAct). A trajectory that asks for
more turns than were stored gets an ``EngineError`` (its re-run ends with ``engine_error``).

A loop whose rewards judge a group together (``AgentLoop.finish_group``: a verifiers rubric with
group reward functions, TRL reward functions) gets the re-run group once all its members have
re-run, as ``RolloutRunner`` hands it on, before any member is compared: the members re-run
together are the stored group's members (same split, step and group id) among the records, plus
``companions``: stored members that complete a group without being compared or returned
(``agentrl replay rerun`` adds them when its filters select part of a group).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from agentrl.agent.loop import LoopContext
from agentrl.agent.runner import LoopTable, finish_group, judges_groups
from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.errors import DataError, EngineError
from agentrl.data.rollout_store import RolloutStore, StoredTrajectory, TrajectoryFilter
from agentrl.trajectory import Trajectory

__all__ = ["ReplayEngine", "Difference", "RerunResult", "compare_trajectories", "rerun_trajectories", "group_key",
           "group_companions"]


class ReplayEngine:
    """An engine that returns the stored sampled tokens of each trajectory, turn by turn."""

    def __init__(self, trajectories: Iterable[Trajectory]):
        self._turns: dict[str, deque[tuple[list[int], list[float]]]] = {}
        for t in trajectories:
            session = f"{t.row_id}#{t.sample_index}"
            if session in self._turns:
                raise ValueError(f"two trajectories share the session {session!r}; replay them in separate engines")
            self._turns[session] = deque(  # every segment's, oldest first (agent.history=as_template)
                (part.response_ids[x.start : x.end], part.logprobs[x.start : x.end])
                for part in [*t.earlier_segments, t] for x in part.turns if x.role == "assistant"
            )
        self._served: dict[str, int] = {}
        self.weight_version = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        session = request.session_id or ""
        queue = self._turns.get(session)
        if queue is None:
            raise EngineError(f"ReplayEngine has no stored trajectory for session {session!r}")
        if not queue:
            raise EngineError(f"trajectory {session}: the re-run asks for assistant turn {self._served.get(session, 0) + 1}, "
                              f"but only {self._served.get(session, 0)} were stored")
        ids, logprobs = queue[0]
        limit = request.sampling.max_new_tokens
        stops = set(request.sampling.stop_token_ids)
        cut = next((i + 1 for i, token in enumerate(ids[:limit]) if token in stops), None)
        if cut is not None:
            n, reason = cut, FinishReason.STOP
        else:
            n, reason = min(len(ids), limit), FinishReason.LENGTH
        if n < len(ids):
            queue[0] = (ids[n:], logprobs[n:])  # the next call continues this turn
        else:
            queue.popleft()
            self._served[session] = self._served.get(session, 0) + 1
        return GenerateResult(
            output_ids=list(ids[:n]), logprobs=list(logprobs[:n]), finish_reason=reason,
            matched_stop=ids[n - 1] if reason is FinishReason.STOP else None, prompt_tokens=len(request.input_ids),
            weight_version=self.weight_version,
        )

    def unserved(self, session: str) -> int:
        """Stored assistant turns (or pieces of one) the re-run did not ask for."""
        return len(self._turns.get(session, ()))

    async def abort(self, rid: str) -> None:
        return None

    async def update_weights(self, state_dict=None, *, path=None, version=None) -> None:
        self.weight_version = version if version is not None else self.weight_version + 1

    async def health(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Difference:
    """One way a re-run differs from the stored trajectory."""

    kind: str  # segments | prompt | turns | observation | assistant | template | turn_reward | tool_call | finish_reason | reward | loop_error
    turn: int | None  # index into the stored turns, when the difference is one turn's
    detail: str  # what differs, for a person
    stored_ids: tuple[int, ...] = ()
    rerun_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class RerunResult:
    stored: StoredTrajectory
    rerun: Trajectory | None  # None when the loop raised (a ``loop_error`` difference says why)
    differences: list[Difference] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return not self.differences


def _text(ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> str:
    return repr(decode(list(ids))) if decode is not None else str(list(ids))


def _ids_detail(a: Sequence[int], b: Sequence[int], decode: Callable[[list[int]], str] | None) -> str:
    return f"stored {_text(a, decode)}, re-run {_text(b, decode)}"


def compare_trajectories(stored: Trajectory, rerun: Trajectory, *, decode: Callable[[list[int]], str] | None = None) -> list[Difference]:
    """Every difference between a stored trajectory and its re-run, in stream order: each segment
    (``Trajectory.earlier_segments``, then the last) token for token, then calls, finish and reward."""
    diffs: list[Difference] = []
    stored_parts, rerun_parts = [*stored.earlier_segments, stored], [*rerun.earlier_segments, rerun]
    if len(stored_parts) != len(rerun_parts):
        diffs.append(Difference("segments", None, f"{len(stored_parts)} segments stored, {len(rerun_parts)} in the re-run "
                                "(the chat template or agent.history changed where the history is rewritten)"))
    for k, (a, b) in enumerate(zip(stored_parts, rerun_parts)):
        diffs += _compare_stream(a, b, decode, "" if len(stored_parts) == 1 else f"segment {k}: ")
    return diffs + _compare_outcome(stored, rerun)


def _compare_stream(stored: Any, rerun: Any, decode: Callable[[list[int]], str] | None, where: str) -> list[Difference]:
    """The differences between two token streams (a trajectory or one of its segments)."""
    diffs: list[Difference] = []
    if stored.prompt_ids != rerun.prompt_ids:
        diffs.append(Difference("prompt", None, where + "prompt tokens differ (chat template, tool schemas or the row changed): "
                                + _ids_detail(stored.prompt_ids, rerun.prompt_ids, decode),
                                tuple(stored.prompt_ids), tuple(rerun.prompt_ids)))
    for k, (a, b) in enumerate(zip(stored.turns, rerun.turns)):
        a_ids, b_ids = stored.response_ids[a.start : a.end], rerun.response_ids[b.start : b.end]
        if a.role != b.role:
            diffs.append(Difference("turns", k, f"{where}turn {k} was {a.role}, re-run {b.role}"))
            break  # the streams no longer line up
        if a_ids != b_ids:
            kind = "assistant" if a.role == "assistant" else "observation"
            diffs.append(Difference(kind, k, f"{where}turn {k} ({a.role}) tokens differ: " + _ids_detail(a_ids, b_ids, decode),
                                    tuple(a_ids), tuple(b_ids)))
        elif a.reward != b.reward:
            diffs.append(Difference("turn_reward", k, f"{where}turn {k} ({a.role}) reward was {a.reward}, re-run {b.reward}"))
    common = min(len(stored.turns), len(rerun.turns))
    for k, x in enumerate(stored.turns[common:], start=common):
        ids = stored.response_ids[x.start : x.end]
        diffs.append(Difference("turns", k, f"{where}turn {k} ({x.role}) is stored but not in the re-run: {_text(ids, decode)}",
                                stored_ids=tuple(ids)))
    for k, x in enumerate(rerun.turns[common:], start=common):
        ids = rerun.response_ids[x.start : x.end]
        diffs.append(Difference("turns", k, f"{where}turn {k} ({x.role}) is only in the re-run: {_text(ids, decode)}",
                                rerun_ids=tuple(ids)))
    if len(stored.turns) == len(rerun.turns) and stored.turns:
        a_tail = stored.response_ids[stored.turns[-1].end :]
        b_tail = rerun.response_ids[rerun.turns[-1].end :]
        if a_tail != b_tail:
            diffs.append(Difference("template", None, where + "tokens after the last turn differ: " + _ids_detail(a_tail, b_tail, decode),
                                    tuple(a_tail), tuple(b_tail)))
    return diffs


def _compare_outcome(stored: Trajectory, rerun: Trajectory) -> list[Difference]:
    """The differences in tool calls, finish reason and reward."""
    diffs: list[Difference] = []
    for i, (a, b) in enumerate(zip(stored.tool_calls, rerun.tool_calls)):
        if (a.name, a.arguments, a.result, a.error, a.reward) != (b.name, b.arguments, b.result, b.error, b.reward):
            diffs.append(Difference("tool_call", a.turn, f"tool call {i} ({a.name}) returned {a.result!r} "
                                    f"(error {a.error}), re-run {b.result!r} (error {b.error})"))
    if len(stored.tool_calls) != len(rerun.tool_calls):
        diffs.append(Difference("tool_call", None, f"{len(stored.tool_calls)} tool calls stored, {len(rerun.tool_calls)} in the re-run"))
    if stored.finish_reason != rerun.finish_reason:
        error = rerun.reward_info.get("error")
        diffs.append(Difference("finish_reason", None, f"finished with {stored.finish_reason}, re-run with {rerun.finish_reason}"
                                + (f" ({error})" if error else "")))
    if stored.reward != rerun.reward:
        diffs.append(Difference("reward", None, f"reward was {stored.reward:g}, re-run {rerun.reward:g}"))
    return diffs


async def rerun_trajectories(
    records: Sequence[StoredTrajectory],
    ctx: LoopContext,
    loops: LoopTable,
    *,
    max_concurrency: int = 64,
    decode: Callable[[list[int]], str] | None = None,
    on_result: Callable[[RerunResult], Any] | None = None,
    companions: Sequence[StoredTrajectory] = (),
) -> list[RerunResult]:
    """Run each record's row through the loop that made it (its ``agent_name``), with
    ``ReplayEngine`` in place of ``ctx.engine``; results come back in the records' order.

    The members of a stored group (same split, step and group id) re-run together and, when
    their loop judges groups, go through its ``finish_group`` before they are compared;
    ``companions`` are re-run only to complete their groups. Groups whose sessions meet (a row
    met again at a later step) go in separate waves, so each engine serves one stored
    trajectory per session."""
    everything = [*records, *companions]
    missing = [r for r in everything if r.row is None]
    if missing:
        r = missing[0]
        raise DataError(f"trajectory {r.session_id} (step {r.step}) was stored without its dataset row; a re-run needs "
                        f"the row (write the store with RolloutStore.write_step(..., rows=...)) "
                        f"[{len(missing)} of {len(everything)} trajectories lack it]", field="row")
    results: list[RerunResult | None] = [None] * len(records)
    for wave in _waves(everything):
        engine = ReplayEngine(everything[i].trajectory for group in wave for i in group)
        wave_ctx = dataclasses.replace(ctx, engine=engine)
        semaphore = asyncio.Semaphore(max_concurrency)
        reruns: dict[int, Trajectory | Exception] = {}

        async def one(i: int) -> None:
            t = everything[i].trajectory
            try:
                async with semaphore:
                    new = await loops.get(t.agent_name).run(
                        everything[i].row, wave_ctx, row_id=t.row_id, group_id=t.group_id, sample_index=t.sample_index,  # type: ignore[arg-type]
                        seed=None,
                    )
            except Exception as exc:  # a plugin that now fails is a finding, not a crash of the whole re-run
                reruns[i] = exc
            else:
                new.policy_version = t.policy_version  # in place: the loop may hold it until finish_group scores it
                reruns[i] = new

        async def group_of(members: list[int]) -> None:
            await asyncio.gather(*(one(i) for i in members))
            loop = loops.get(everything[members[0]].trajectory.agent_name)
            ran = [x for i in members if isinstance(x := reruns[i], Trajectory)]
            if ran and judges_groups(loop):
                await finish_group(loop, ran)
            for i in members:
                if i >= len(records):  # a companion: scored with its group, not compared
                    continue
                new = reruns[i]
                if isinstance(new, Exception):
                    result = RerunResult(records[i], None, [Difference("loop_error", None,
                                                                       f"the loop raised {type(new).__name__}: {new}")])
                else:
                    result = RerunResult(records[i], new, compare_trajectories(records[i].trajectory, new, decode=decode))
                results[i] = result
                if on_result is not None:
                    on_result(result)

        await asyncio.gather(*(group_of(group) for group in wave))
    return [r for r in results if r is not None]


def group_key(record: StoredTrajectory) -> tuple[str, int, str]:
    """The stored group a trajectory belongs to: (split, step, group id)."""
    return record.split, record.step, record.trajectory.group_id


def group_companions(store: RolloutStore, records: Sequence[StoredTrajectory], loops: LoopTable) -> list[StoredTrajectory]:
    """The stored members of the records' groups that are not among them, for the groups whose
    loop judges a group together: re-run beside the records (``companions``) so that the group's
    rewards are computed over the group that was stored."""
    wanted = {group_key(r) for r in records if judges_groups(loops.get(r.trajectory.agent_name))}
    if not wanted:
        return []
    have = {(group_key(r), r.trajectory.sample_index) for r in records}
    steps = [step for _, step, _ in wanted]
    found = store.iter_stored(TrajectoryFilter(split=sorted({split for split, _, _ in wanted}), steps=(min(steps), max(steps) + 1)))
    return [r for r in found if group_key(r) in wanted and (group_key(r), r.trajectory.sample_index) not in have]


def _waves(records: Sequence[StoredTrajectory]) -> list[list[list[int]]]:
    """Groups of record indexes (each in sample order), packed into waves whose sessions differ. A
    session met twice in one stored group (a step written twice) starts another group."""
    groups: dict[tuple[str, int, str, int], list[int]] = {}
    seen: dict[tuple[tuple[str, int, str], str], int] = {}
    for i, record in enumerate(records):
        key = group_key(record)
        copy = seen[(key, record.session_id)] = seen.get((key, record.session_id), -1) + 1
        groups.setdefault((*key, copy), []).append(i)
    waves: list[tuple[set[str], list[list[int]]]] = []
    for members in groups.values():
        members.sort(key=lambda i: records[i].trajectory.sample_index)
        sessions = {records[i].session_id for i in members}
        for taken, wave in waves:
            if not taken & sessions:
                taken |= sessions
                wave.append(members)
                break
        else:
            waves.append((sessions, [members]))
    return [wave for _, wave in waves]

"""The agent-loop API (entry point group ``agentrl.agent_loops``).

A loop turns one dataset row into one ``Trajectory``. Subclasses implement ``play``, which
drives an ``Episode`` (generate, parse, call tools, talk to the interaction) and returns the
finish reason; the base ``run`` owns everything that must hold for every loop: tool instances
created once and released always, the interaction finalized always, the per-trajectory
timeout, engine failures recorded as ``engine_error``, rewards, and metrics. A loop that needs
full control may override ``run`` itself.

Every turn starts through the episode (``generate`` or ``assistant_turn``, ``call_tools``, ``observe``), and each of
them asks ``Episode.check_turn`` first - the one place the turn limits are checked, so a loop
(a plugin's too) never checks them itself:

* ``max_assistant_turns`` / ``max_user_turns``: no further turn of that kind is started, and no
  observation is added (no tool executed) when no assistant turn is left to read it;
* ``max_response_tokens`` (the whole response, sampled and observed): the next generation gets
  at most what is left, and an observation that does not fit ends the episode;
* ``max_tool_response_tokens``: each tool result is cut to this many tokens with a visible
  ``...[truncated N tokens]`` marker;
* ``tool_timeout_s`` per call and ``trajectory_timeout_s`` per episode.

What ended an episode is a ``agentrl.trajectory.TrajectoryFinish`` (documented there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from agentrl.agent.call_stats import read_turn
from agentrl.agent.history import HistoryPolicy, fresh_request
from agentrl.agent.render import ChatRenderer
from agentrl.agent.setup import Limits
from agentrl.agent.tool_parsers import ParsedCall, ParsedTurn, ToolParser
from agentrl.agent.tools_runtime import CallOutcome, InteractionPool, InteractionSession, ToolBox, ToolSession
from agentrl.config.schema import EnvironmentConfig, RewardComponents
from agentrl.data.row import EnvironmentRef, Row
from agentrl.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.errors import EngineError
from agentrl.rewards import score_to_float
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, TrajectoryFinish, TrajectorySegment, Turn, TurnRole

__all__ = ["AgentLoop", "AssistantTurn", "LoopContext", "Limits", "Episode", "RewardFn", "EpisodeEnd", "TrajectoryFinish",
           "ask_interaction"]

def trajectory_instance_id(group_id: str, sample_index: int) -> str:
    """The instance id a trajectory's tools and interaction get: ``{group_id}#{sample_index}``,
    derived from the trajectory's identity alone (no per-process part), so it is the same in
    every process and every run over the same data, and a tool may seed from it."""
    return f"{group_id}#{sample_index}"


# compute_score(data_source, solution, ground_truth, extra_info) -> float | {"score": float, ...}
RewardFn = Callable[[str, str, Any, dict[str, Any]], Any]


@dataclass(slots=True)
class LoopContext:
    """What a loop needs, built once per worker (``agentrl.agent.runner.build_context``, from a
    ``RolloutSetup``) and shared by its trajectories."""

    engine: Engine
    renderer: ChatRenderer
    parser: ToolParser  # of every loop not in parser_by_loop
    toolbox: ToolBox
    interactions: InteractionPool
    limits: Limits
    sampling: SamplingParams
    reward_fn: Callable[[str], RewardFn | None]  # data_source -> reward function
    parser_by_loop: Mapping[str, ToolParser] = field(default_factory=dict)  # loop name -> its parser
    policy_version: int = 0
    reward_components: RewardComponents = field(default_factory=RewardComponents)  # reward.components
    # the config's environment section (agentrl.environments): the ref of rows that name none, library settings
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    history: HistoryPolicy = "as_template"  # agent.history (agentrl.agent.history) of every loop not in history_by_loop
    history_by_loop: Mapping[str, HistoryPolicy] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)  # agent.roles: role -> policy (agentrl.agent.roles)
    policy_versions: Mapping[str, int] = field(default_factory=dict)  # trained role -> its own policy's weight version

    def version_of(self, policy: str) -> int:  # a trajectory's policy_version ("": the main policy's)
        return self.policy_versions.get(policy, self.policy_version)

    def parser_for(self, loop_name: str) -> ToolParser:
        return self.parser_by_loop.get(loop_name, self.parser)

    def history_for(self, loop_name: str) -> HistoryPolicy:
        return self.history_by_loop.get(loop_name, self.history)

    @property
    def default_environment(self) -> EnvironmentRef | None:
        """The config's environment ref (None when ``environment.library`` is null)."""
        return EnvironmentRef.from_config(self.environment)

    def environment_ref(self, row: Row) -> EnvironmentRef | None:
        """The environment a row runs in: its own ``extra_info.environment``, else the config's."""
        return row.environment_ref(self.default_environment)


class EpisodeEnd(Exception):
    """Raised inside ``play`` to end the episode with a finish reason."""

    def __init__(self, reason: TrajectoryFinish | str):
        reason = TrajectoryFinish.parse(reason, where="EpisodeEnd")
        super().__init__(reason.value)
        self.reason = reason


@dataclass(slots=True)
class AssistantTurn:
    """One assistant turn, sampled, recorded and parsed (``Episode.assistant_turn``)."""

    turn: Turn  # its token span in the trajectory's turns, and its reward (tool or interaction rewards add to it)
    index: int  # its index in the trajectory's turns: what ``call_tools`` and ``ToolCallRecord.turn`` refer to
    result: GenerateResult  # the engine's answer (ids, logprobs, finish reason)
    text: str  # the sampled text, without the end-of-turn token
    parsed: ParsedTurn  # the episode's parser's reading of ``text``: the content and the tool calls


class SamplerBooks(Protocol):
    """What a sampler of one trajectory keeps of its engine calls (``Episode``, ``EndpointSession``)."""

    session_id: str
    seed: int | None
    policy: str  # the policy that samples (GenerateRequest.policy): "" the main one, a trained role's own
    gen_time: float
    weight_versions: list[int]  # of every sampled token (metrics weight_version_min/max)
    error: str | None


@dataclass(frozen=True, slots=True)
class SampledTurn:
    """One engine call's answer, read as an assistant turn (``sample_turn``)."""

    result: GenerateResult
    versions: list[int]  # the weight version of each sampled token
    stopped_on_eos: bool  # it ended on one of the family's end-of-turn ids
    text: str  # the sampled text, without that id


async def sample_turn(
    books: SamplerBooks, engine: Engine, renderer: ChatRenderer, rollout: SamplingParams, input_ids: list[int], *,
    call: int, max_new_tokens: int, stop_token_ids: tuple[int, ...] | None = None, stop: tuple[str, ...] = (),
) -> SampledTurn:
    """The one place where a trajectory's turn is sampled (the loops' ``Episode.generate``, the
    OpenAI endpoint's ``EndpointSession``): call ``call`` of the trajectory, with the rollout's
    sampling, a request id and seed derived from the trajectory's, stopping at the family's
    end-of-turn ids (or ``stop_token_ids``) and ``stop`` strings, its time added to ``books``.

    An engine failure ends the trajectory with ``engine_error`` (the message in ``books.error``),
    an aborted request with ``abort`` (``EpisodeEnd``); nothing of either call is kept. Otherwise
    the weight versions of its tokens are recorded, and the text is decoded without the
    end-of-turn id the turn stopped on."""
    turn_ends = rollout.stop_token_ids or (renderer.eos_id,)  # every end-of-turn / eos id of the family
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        stop_token_ids=stop_token_ids or turn_ends, stop=stop,
        seed=None if books.seed is None else books.seed + 7919 * call,
    )
    request = GenerateRequest(input_ids=input_ids, sampling=sampling, rid=f"{books.session_id}/{call}",
                              session_id=books.session_id, policy=books.policy)
    start = time.perf_counter()
    try:
        result = await engine.generate(request)
    except EngineError as exc:
        books.error = str(exc)
        raise EpisodeEnd(TrajectoryFinish.ENGINE_ERROR) from exc
    finally:
        books.gen_time += time.perf_counter() - start
    if result.finish_reason is FinishReason.ABORT:
        raise EpisodeEnd(TrajectoryFinish.ABORT)
    versions = result.token_versions()
    books.weight_versions.extend(versions or [result.weight_version])
    ids = result.output_ids
    stopped = result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and bool(ids) and ids[-1] in turn_ends
    if stopped and result.finish_reason is FinishReason.LENGTH:  # the end-of-turn id was the last one allowed (engines
        result = dataclasses.replace(result, finish_reason=FinishReason.STOP, matched_stop=ids[-1])  # check length first)
    return SampledTurn(result, versions, stopped, renderer.decode(ids[:-1] if stopped else ids))


class Episode:
    """One trajectory in the making: the token stream, the messages, tools, interaction, counters."""

    def __init__(
        self,
        row: Row,
        ctx: LoopContext,
        *,
        row_id: str,
        group_id: str,
        sample_index: int,
        seed: int | None,
        tools: ToolSession,
        interaction: InteractionSession | None,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        parser: ToolParser | None = None,
        prompt_tools: list[dict[str, Any]] | None = None,
        history: HistoryPolicy | None = None,
    ):
        self.row, self.ctx = row, ctx
        self.parser = parser if parser is not None else ctx.parser  # the playing loop's (LoopContext.parser_for)
        self.history = history if history is not None else ctx.history  # the playing loop's (LoopContext.history_for)
        self.row_id, self.group_id, self.sample_index, self.seed = row_id, group_id, sample_index, seed
        self.session_id = f"{row_id}#{sample_index}"
        self.policy = ""  # the main policy; a trained role's episode samples from its own (agentrl.agent.roles)
        self.tools, self.interaction = tools, interaction
        self.messages = messages
        self.prompt_tools = prompt_tools  # the tools block the template renders (for a fresh rendering)
        self.builder = TrajectoryBuilder(prompt_ids)
        # the stretches before the template rewrote the history (agent.history=as_template), oldest first
        self.earlier_segments: list[TrajectorySegment] = []
        self._earlier_tokens = 0  # their response tokens and the observations that ended them
        self.tool_calls: list[ToolCallRecord] = []
        self.counts: Counter[str] = Counter()
        self.gen_time = 0.0
        # the engine weight versions that sampled this episode's tokens (metrics weight_version_min/max)
        self.weight_versions: list[int] = []
        self.tool_time = 0.0
        self.last_stopped_on_eos = False
        self.own_score: float | None = None  # a loop may score its own trajectory
        self.error: str | None = None  # what went wrong, when an error ended the episode
        self.final_answer: str | None = None  # for loops with an explicit final answer (react)
        self.interaction_score: float | None = None  # the interaction's calculate_score, recorded in reward_info

    # ----------------------------------------------------------------- generation
    @property
    def assistant_turns(self) -> int:
        return self.counts["assistant_turns"]

    @property
    def user_turns(self) -> int:
        return self.counts["user_turns"]

    @property
    def turn_index(self) -> int:
        """The index of the latest turn in the trajectory's ``turns`` (assistant and observation
        turns alike; -1 before the first): what ``call_tools`` and a per-turn reward refer to."""
        return len(self.builder.turns) - 1

    def add_assistant_message(self, content: str, **fields: Any) -> dict[str, Any]:
        """Record what the model said in the conversation (``messages``; its tokens are already
        in the trajectory from ``generate``); extra fields such as ``tool_calls`` go with it."""
        message = {"role": "assistant", "content": content, **fields}
        self.messages.append(message)
        return message

    @property
    def tokens_left(self) -> int:
        """What ``max_response_tokens`` leaves for the rest of the response."""
        return self.ctx.limits.max_response_tokens - len(self.builder) - self._earlier_tokens

    def check_turn(self, role: TurnRole | None, tokens: int = 1) -> int:
        """The one check of every turn limit, made before anything is added to the episode:
        a new turn of ``role`` (None: more of the current assistant turn) of ``tokens`` tokens
        (for an assistant turn: at least one). Ends the episode (``EpisodeEnd``) when a limit
        forbids it; returns the response tokens left after it."""
        limits = self.ctx.limits
        if role == "user" and self.user_turns >= limits.max_user_turns:
            raise EpisodeEnd(TrajectoryFinish.MAX_USER_TURNS)
        # an assistant turn cannot start, and an observation would be read by no turn
        if role is not None and self.assistant_turns >= limits.max_assistant_turns:
            raise EpisodeEnd(TrajectoryFinish.MAX_ASSISTANT_TURNS)
        left = self.tokens_left - tokens
        if left < 0:
            raise EpisodeEnd(TrajectoryFinish.RESPONSE_BUDGET)
        return left

    async def generate(
        self, *, stop_token_ids: tuple[int, ...] | None = None, continue_turn: bool = False
    ) -> tuple[Turn, GenerateResult, str]:
        """Sample the next assistant turn (or, with ``continue_turn``, more of the current one);
        returns the turn, the engine result and the text of the newly sampled tokens."""
        # the tokens this turn may sample: what is left after its first one, plus that one
        budget = self.check_turn(None if continue_turn else "assistant") + 1
        call = self.counts["generate_calls"]
        self.counts["generate_calls"] += 1
        try:
            sampled = await sample_turn(self, self.ctx.engine, self.ctx.renderer, self.ctx.sampling, self.builder.all_ids,
                                        call=call, max_new_tokens=min(self.ctx.limits.max_new_tokens, budget),
                                        stop_token_ids=stop_token_ids)
        except EpisodeEnd as end:
            if end.reason is TrajectoryFinish.ENGINE_ERROR:
                self.counts["engine_errors"] += 1
            raise
        result = sampled.result
        turns_before = len(self.builder.turns)
        turn = self.builder.append_sampled(result.output_ids, result.logprobs, extend=continue_turn,
                                           versions=sampled.versions)
        if len(self.builder.turns) > turns_before:
            self.counts["assistant_turns"] += 1
        self.last_stopped_on_eos = sampled.stopped_on_eos
        return turn, result, sampled.text

    async def assistant_turn(self) -> AssistantTurn:
        """Sample the next assistant turn and read its tool calls: the step every loop whose
        model answers in the chat template's tool-calling format starts its turns with
        (``tool_agent``, ``trl_env``, ``openenv_env``'s tool actions).

        Guarantees, in order: the turn's tokens are in the trajectory exactly as sampled
        (``generate``: the turn limits are checked first; an engine failure or an abort ends the
        episode); its text is parsed by the episode's parser (``agent.tool_parser``, or
        ``agent.tool_parser_by_loop.<loop>``); the assistant message (the parsed content, with
        ``tool_calls`` when it made any) is added to ``messages``; and a turn that
        ``max_new_tokens`` or the response budget cut ends the episode with ``length``, its calls
        neither executed nor returned. What to do with the calls or the answer is the loop's."""
        turn, result, text = await self.generate()
        index = self.turn_index
        parsed = read_turn(self.parser, text, self.tools.schemas(), self.counts)  # metrics tool_calls/parsed, ... (call_stats)
        calls = {"tool_calls": [call.as_message_call() for call in parsed.calls]} if parsed.calls else {}
        self.add_assistant_message(parsed.content, **calls)
        if result.finish_reason is FinishReason.LENGTH:
            raise EpisodeEnd(TrajectoryFinish.LENGTH)
        return AssistantTurn(turn=turn, index=index, result=result, text=text, parsed=parsed)

    # ----------------------------------------------------------------- observations
    def observe(self, messages: list[dict[str, Any]], role: TurnRole) -> Turn:
        """Append tool or user messages as a masked delta (ends the episode if it cannot fit).

        Under ``agent.history=as_template`` with a template that rewrites the history (drops
        earlier reasoning, moves the system prompt: ``agentrl.agent.history``), the conversation
        is rendered afresh; when the stream with the delta is not that rendering, the tokens so
        far become an earlier segment (exact as sampled, under their own prompt) and a new one
        starts from the fresh rendering: every request is what the template gives the model at
        inference."""
        renderer = self.ctx.renderer
        text = renderer.observation_text(messages, after_eos=self.last_stopped_on_eos)
        ids = renderer.encode(text)
        fresh = fresh_request(renderer, self.history, self.builder.all_ids, text, self.messages + messages, self.prompt_tools)
        if fresh is not None:
            return self._start_segment(fresh, ids, role, messages)
        return self.observe_ids(ids, role, messages)

    def _start_segment(self, prompt_ids: list[int], ids: list[int], role: TurnRole, messages: list[dict[str, Any]]) -> Turn:
        self.check_turn(role, len(ids))  # the limits count as if the observation were appended
        if role == "user":
            self.counts["user_turns"] += 1
        self.messages.extend(messages)
        b = self.builder
        self.earlier_segments.append(TrajectorySegment(b.prompt_ids, b.response_ids, b.response_mask, b.logprobs, b.turns,
                                                      b.token_versions))
        self._earlier_tokens += len(b) + len(ids)
        self.builder = TrajectoryBuilder(prompt_ids)
        self.counts["template_segments"] += 1
        return Turn(role=role, start=0, end=0)  # in the new segment's prompt, not in a response

    def observe_ids(self, ids: list[int], role: TurnRole, messages: list[dict[str, Any]]) -> Turn:
        self.check_turn(role, len(ids))
        if role == "user":
            self.counts["user_turns"] += 1
        self.messages.extend(messages)
        return self.builder.append_observed(ids, role)

    def truncate_tool_text(self, text: str) -> str:
        limit = self.ctx.limits.max_tool_response_tokens
        if self.ctx.renderer.surely_fits(text, limit):
            return text
        ids = self.ctx.renderer.encode(text)
        if len(ids) <= limit:
            return text
        self.counts["tool_responses_truncated"] += 1
        return self.ctx.renderer.decode(ids[:limit]) + f"...[truncated {len(ids) - limit} tokens]"

    async def call_tools(self, turn_index: int, parsed: ParsedTurn) -> list[CallOutcome]:
        """Execute a turn's calls, apply the malformed-call policy, record and count everything.

        With no assistant turn left to read their results, the calls are not executed (metric
        ``tool_calls_unexecuted``) and the episode ends with ``max_assistant_turns``."""
        self.check_tool_turn(parsed.calls)
        start = time.perf_counter()
        outcomes = await self.tools.execute_all(parsed.calls)
        self.tool_time += time.perf_counter() - start
        malformed = False
        for outcome in outcomes:
            malformed |= self.record_tool_call(turn_index, outcome)
        if malformed:
            self.apply_malformed_policy(self.builder.turns[turn_index])
        return outcomes

    # a loop that executes a turn's calls itself (openenv_env: each call a step) keeps the same
    # books with these three, in this order: check, record each call, apply the policy
    def check_tool_turn(self, calls: list[ParsedCall]) -> None:
        """Before executing ``calls``: with no assistant turn left to read their results, they are
        not executed (metric ``tool_calls_unexecuted``) and the episode ends (``max_assistant_turns``)."""
        try:
            self.check_turn("tool", 0)
        except EpisodeEnd:
            self.counts["tool_calls_unexecuted"] += len(calls)
            raise

    def record_tool_call(self, turn_index: int, outcome: CallOutcome, *, turn_reward: bool = True) -> bool:
        """Count one executed call (``tool_calls``, ``tool_errors/<kind>``) and keep it in the
        trajectory (``ToolCallRecord``); its reward is added to the turn's unless ``turn_reward`` is
        False (a loop that rewards its turns itself). True when the call was malformed (``bad_json``,
        ``unknown_tool``, ``invalid_arguments``): what ``apply_malformed_policy`` is for."""
        self.counts["tool_calls"] += 1
        malformed = False
        if outcome.error is not None:
            self.counts[f"tool_errors/{outcome.error}"] += 1
            malformed = outcome.error in ("bad_json", "unknown_tool", "invalid_arguments")
        if turn_reward and outcome.reward is not None:
            turn = self.builder.turns[turn_index]
            turn.reward = (turn.reward or 0.0) + outcome.reward
        self.tool_calls.append(
            ToolCallRecord(
                turn=turn_index, name=outcome.call.name, arguments=outcome.call.arguments, raw=outcome.call.raw,
                result=outcome.text, error=outcome.error, reward=outcome.reward, duration_s=outcome.duration_s,
                metrics=dict(outcome.metrics or {}),
            )
        )
        return malformed

    def apply_malformed_policy(self, turn: Turn) -> None:
        """``agent.malformed_call_policy`` for a turn that made a malformed call: ``end`` ends the
        episode (``malformed_tool_call``), ``penalize`` adds ``malformed_call_penalty`` to the
        turn's reward, ``feedback`` leaves the error messages as the model's to read."""
        policy = self.ctx.limits.malformed_call_policy
        if policy == "end":
            raise EpisodeEnd(TrajectoryFinish.MALFORMED_TOOL_CALL)
        if policy == "penalize":
            turn.reward = (turn.reward or 0.0) + self.ctx.limits.malformed_call_penalty


class AgentLoop:
    """Base of every agent loop. Subclasses implement ``play``; ``run`` keeps the invariants."""

    name: str = "base"  # also the key of agent.tool_parser_by_loop

    def initial_messages(self, row: Row, ctx: LoopContext, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return row.messages()

    def prompt_tools(self, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The tools rendered by the chat template (None: the loop describes them itself)."""
        return tool_schemas or None

    async def finish_group(self, group: list[Trajectory]) -> None:
        """Called by ``RolloutRunner`` once every sample of a group (the ``n`` samples of a row)
        has finished, in sample order, before any of them is handed on: a loop whose rewards
        judge the group together (a verifiers rubric's group reward functions) sets them here.
        Only a loop that overrides it makes the runner wait for whole groups."""

    async def play(self, episode: Episode) -> TrajectoryFinish:
        """Play the episode; return how it finished (or raise ``EpisodeEnd``). The episode checks
        the limits: a ``generate``, ``call_tools`` or ``observe`` that a limit forbids raises."""
        raise NotImplementedError

    async def run(
        self,
        row: Row,
        ctx: LoopContext,
        *,
        row_id: str,
        group_id: str,
        sample_index: int = 0,
        seed: int | None = None,
    ) -> Trajectory:
        # the trajectory's identity, the same in every process: the group id holds the purpose,
        # step and row's position in the batch (two rows may share a row id: verl files index each
        # split from 0), so no two trajectories of a run collide, and a tool can seed from it
        instance_id = trajectory_instance_id(group_id, sample_index)
        extra = row.extra_info
        tools = ctx.toolbox.session(instance_id, extra.tools_kwargs)
        interaction = (
            ctx.interactions.session(instance_id, extra.interaction_kwargs.model_dump())
            if extra.interaction_kwargs is not None
            else None
        )
        async with tools:
            schemas = tools.schemas()
            messages = self.initial_messages(row, ctx, schemas)
            prompt_ids = ctx.renderer.prompt_ids(messages, self.prompt_tools(schemas))
            episode = Episode(
                row, ctx, row_id=row_id, group_id=group_id, sample_index=sample_index, seed=seed, tools=tools,
                interaction=interaction, messages=messages, prompt_ids=prompt_ids, parser=ctx.parser_for(self.name),
                prompt_tools=self.prompt_tools(schemas), history=ctx.history_for(self.name),
            )
            try:
                finish, error = await self._play(episode, interaction)
                if interaction is not None and finish is not TrajectoryFinish.INTERACTION_ERROR:
                    try:
                        episode.interaction_score = await interaction.score()
                    except Exception as exc:
                        finish = TrajectoryFinish.INTERACTION_ERROR
                        error = f"calculate_score failed: {type(exc).__name__}: {exc}"
            finally:
                if interaction is not None:
                    await interaction.__aexit__(None, None, None)  # finalize, always
            sep = ctx.renderer.separator_ids
            if (
                episode.last_stopped_on_eos
                and episode.builder.turns
                and episode.builder.turns[-1].role == "assistant"
                and len(sep) <= episode.tokens_left
            ):
                # the separator the template writes after the final end-of-turn token
                episode.builder.append_template(sep)
            await tools.collect_rewards()
        return self._finish(episode, finish, error)

    async def _play(self, episode: Episode, interaction: InteractionSession | None) -> tuple[TrajectoryFinish, str | None]:
        """Start the interaction and play the episode under the trajectory timeout; returns
        (finish reason, error)."""
        try:
            await start_interaction(interaction)
            finish = await asyncio.wait_for(self.play(episode), episode.ctx.limits.trajectory_timeout_s)
            return TrajectoryFinish.parse(finish, where=f"agent loop {self.name!r}: play() returned"), None
        except EpisodeEnd as end:
            return end.reason, episode.error
        except asyncio.TimeoutError:
            return TrajectoryFinish.TRAJECTORY_TIMEOUT, None
        except InteractionFailure as exc:
            return TrajectoryFinish.INTERACTION_ERROR, str(exc)

    def _finish(self, ep: Episode, finish: TrajectoryFinish, error: str | None) -> Trajectory:
        row = ep.row
        solution = self._solution_text(ep)
        reward = 0.0
        info: dict[str, Any] = {}
        if ep.own_score is not None:
            reward = ep.own_score
        else:
            fn = ep.ctx.reward_fn(row.data_source)
            if fn is not None:
                reward, info = score_to_float(fn(row.data_source, solution, row.ground_truth, row.extra_info.model_dump()))
        if ep.tools.calc_rewards:
            info["tool_rewards"] = dict(ep.tools.calc_rewards)
        if ep.tools.calc_reward_errors:
            info["tool_reward_errors"] = dict(ep.tools.calc_reward_errors)
            ep.counts["tool_errors/calc_reward"] += len(ep.tools.calc_reward_errors)
        if ep.interaction_score is not None:
            info["interaction_score"] = float(ep.interaction_score)
        weights = ep.ctx.reward_components
        if not weights.is_score_only:  # reward.components: the reward function's score stays in reward_info
            info["score"] = reward
            reward = weights.total(reward, ep.tools.calc_rewards, ep.interaction_score)
        if error:
            info["error"] = error
        b = ep.builder
        metrics: dict[str, float] = {k: float(v) for k, v in ep.counts.items()}
        metrics.update(
            turns=float(ep.assistant_turns),
            response_tokens=float(len(b.response_ids)),
            sampled_tokens=float(sum(b.response_mask)),
            gen_time_s=ep.gen_time,
            tool_time_s=ep.tool_time,
        )
        if ep.weight_versions:
            metrics.update(weight_version_min=float(min(ep.weight_versions)), weight_version_max=float(max(ep.weight_versions)))
        return Trajectory(
            row_id=ep.row_id, group_id=ep.group_id, sample_index=ep.sample_index, data_source=row.data_source,
            agent_name=self.name, prompt_ids=b.prompt_ids, response_ids=b.response_ids, response_mask=b.response_mask,
            logprobs=b.logprobs, turns=b.turns, messages=ep.messages, finish_reason=finish, reward=reward,
            reward_info=info, tool_calls=ep.tool_calls, metrics=metrics, policy_version=ep.ctx.version_of(ep.policy),
            ground_truth=row.ground_truth, earlier_segments=ep.earlier_segments, token_versions=b.token_versions,
        )

    def _solution_text(self, ep: Episode) -> str:
        """The text the trajectory reward judges: the last assistant message."""
        for message in reversed(ep.messages):
            if message["role"] == "assistant":
                return message.get("content") or ""
        return ""


class InteractionFailure(Exception):
    """An interaction raised: the episode ends with ``interaction_error``."""


async def start_interaction(interaction: InteractionSession | None) -> None:
    """Start an episode's interaction (if any); its failure is an ``InteractionFailure``."""
    if interaction is None:
        return
    try:
        await interaction.__aenter__()
    except Exception as exc:
        raise InteractionFailure(f"start failed: {type(exc).__name__}: {exc}") from exc


async def ask_interaction(ep: Episode, turn: Turn) -> bool:
    """Let the interaction answer the assistant turn just finished; True when the episode goes on."""
    assert ep.interaction is not None
    try:
        response = await ep.interaction.respond(ep.messages)
    except Exception as exc:
        raise InteractionFailure(f"{type(exc).__name__}: {exc}") from exc
    turn.reward = (turn.reward or 0.0) + float(response.reward)
    for key, value in response.metrics.items():
        ep.counts[f"interaction/{key}"] += value  # type: ignore[assignment]
    if response.done:
        if response.text:  # how the episode ended ("correct"): in the messages, a record; never in the tokens
            ep.messages.append({"role": "user", "content": response.text})
        raise EpisodeEnd(TrajectoryFinish.INTERACTION_DONE)
    ep.check_turn("user", 0)  # before rendering: the turn limits end the episode first
    ep.observe([{"role": "user", "content": response.text}], "user")
    return True

"""``openenv_env``: a row of an OpenEnv environment, played through the environment's client.

Per trajectory (``agentrl.environments.openenv`` has the server and session side):

1. a session of this worker's server of the environment, ``reset(**args)`` with the row's
   ``extra_info.environment.args`` (else ``environment.args``) and ``episode_id`` the trajectory's
   instance id; the reset observation follows the row's prompt as a user message;
2. each assistant turn is an action: with a text action (one string field) the reply text is the
   action (also when ``rollout.max_new_tokens`` cut it: the environment judges what the model
   wrote), and the next observation comes back as a user message; otherwise the action is a tool
   (its fields are the parameters), each tool call a ``step``, each observation the call's tool
   result; an MCP environment's action (``CallToolAction``) offers the environment's MCP tools
   instead (``list_tools`` after reset), each call a ``call_tool`` step. A reply without a tool
   call ends the episode (``stop``);
3. each step's reward judges the assistant turn that made the action: its turn reward
   (``environment.openenv.reward=turns``), or their sum is the trajectory reward (``trajectory``);
   ``done`` ends the episode (``stop``);
4. a server that cannot start, dies or does not answer in time, and an exception in the
   environment's code, end the trajectory with ``environment_error`` (out of the loss, counted in
   ``failures/environment_error``); a dead or hung server of agentrl's is restarted by the next
   trajectory (counted in ``env_errors/server_restarts``; each failure in ``env_errors/<kind>``).

Metrics per trajectory: ``env/return`` (the sum of the step rewards), ``env/steps``, ``env/done``.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from agentrl.agent.loop import AgentLoop, Episode, EpisodeEnd, LoopContext, trajectory_instance_id
from agentrl.agent.tool_parsers import ParsedCall
from agentrl.agent.tools_runtime import CallOutcome, schema_problem
from agentrl.config.schema import OpenEnvEnvironmentConfig
from agentrl.data.row import Row
from agentrl.environments.openenv import (ActionSpec, EnvironmentFailure, OpenEnvSession, StepOutcome, mcp_result,
                                         observation_text, server_for)
from agentrl.errors import DataError
from agentrl.trajectory import Trajectory, TrajectoryFinish, Turn


@dataclass
class _EnvEpisode:
    """What one trajectory holds of its environment between ``run`` and ``play``."""

    session: OpenEnvSession | None = None
    action: ActionSpec | None = None
    first: StepOutcome | None = None
    failure: EnvironmentFailure | None = None
    observation_field: str | None = None  # environment.openenv.observation_field
    reward_mode: str = "turns"  # environment.openenv.reward
    steps: int = 0
    total: float = 0.0
    done: bool = False


_CURRENT: contextvars.ContextVar[_EnvEpisode] = contextvars.ContextVar("openenv_episode")


class OpenEnvLoop(AgentLoop):
    name = "openenv_env"

    async def run(self, row: Row, ctx: LoopContext, *, row_id: str, group_id: str, sample_index: int = 0,
                  seed: int | None = None) -> Trajectory:
        ref = ctx.environment_ref(row)
        if ref is None or ref.library != "openenv":
            raise DataError(f"the openenv_env loop needs an OpenEnv environment: set extra_info.environment "
                            f"(library openenv) or environment.library=openenv (row {row_id} has {ref})")
        settings: OpenEnvEnvironmentConfig = ctx.environment.openenv
        state = _EnvEpisode(observation_field=settings.observation_field, reward_mode=settings.reward)
        instance_id = trajectory_instance_id(group_id, sample_index)
        try:
            server = server_for(ref, settings)
            state.session = OpenEnvSession(server, waiter=f"trajectory {instance_id} (openenv_env)")
            state.first = await state.session.open({"episode_id": instance_id, **ref.args}, ctx.limits.trajectory_timeout_s)
            state.action = server.action
            state.done = state.first.done
        except EnvironmentFailure as exc:
            state.failure = exc
        token = _CURRENT.set(state)
        try:
            return await super().run(row, ctx, row_id=row_id, group_id=group_id, sample_index=sample_index, seed=seed)
        finally:
            _CURRENT.reset(token)
            if state.session is not None:
                await state.session.close()

    def initial_messages(self, row: Row, ctx: LoopContext, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages = row.messages()
        state = _CURRENT.get()
        if state.first is not None:
            text = self._observation(state, state.first)
            if text:
                messages.append({"role": "user", "content": text})
        return messages

    def prompt_tools(self, tool_schemas: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return self._tools(_CURRENT.get()) or None

    @staticmethod
    def _tools(state: _EnvEpisode) -> list[dict[str, Any]]:
        """The tools the model is offered: the action as a tool, or an MCP environment's tools."""
        if state.action is None:
            return []
        if state.action.mode == "mcp":
            return state.session.tools if state.session is not None else []
        return state.action.tools()

    def _observation(self, state: _EnvEpisode, outcome: StepOutcome) -> str:
        try:
            return observation_text(outcome.observation, state.observation_field)
        except EnvironmentFailure as exc:
            state.failure = exc
            return ""

    async def play(self, episode: Episode) -> TrajectoryFinish:
        state = _CURRENT.get()
        episode.own_score = 0.0  # the environment's rewards are the reward (no reward function)
        try:
            if state.session is not None and state.session.restarts:
                episode.counts["env_errors/server_restarts"] += state.session.restarts
            if state.failure is not None:
                raise state.failure
            assert state.action is not None and state.session is not None
            if state.done:  # done at reset: nothing to act on
                return TrajectoryFinish.STOP
            if state.action.mode == "text":
                return await self._play_text(episode, state)
            return await self._play_tools(episode, state)
        except EnvironmentFailure as exc:
            episode.error = str(exc)
            episode.counts[f"env_errors/{exc.kind}"] += 1
            raise EpisodeEnd(TrajectoryFinish.ENVIRONMENT_ERROR) from exc
        finally:
            episode.counts["env/steps"] = state.steps
            episode.counts["env/return"] = state.total  # type: ignore[assignment]
            episode.counts["env/done"] = int(state.done)
            if state.reward_mode == "trajectory":
                episode.own_score = state.total

    def _reward(self, episode: Episode, state: _EnvEpisode, turn: Turn, outcome: StepOutcome) -> None:
        state.steps += 1
        state.total += outcome.reward
        state.done = outcome.done
        if state.reward_mode == "turns":  # a step's 0.0 too: the turn was judged
            turn.reward = (turn.reward or 0.0) + outcome.reward

    async def _play_text(self, episode: Episode, state: _EnvEpisode) -> TrajectoryFinish:
        assert state.action is not None and state.action.text_field is not None and state.session is not None
        while True:
            turn, _, text = await episode.generate()
            episode.add_assistant_message(text)
            # the reply is the action, whole or cut at rollout.max_new_tokens: the environment judges it
            outcome = await state.session.step({state.action.text_field: text})
            self._reward(episode, state, turn, outcome)
            if outcome.done:
                return TrajectoryFinish.STOP
            observation = self._observation(state, outcome)
            if state.failure is not None:
                raise state.failure
            episode.check_turn("user", 0)
            episode.observe([{"role": "user", "content": observation}], "user")

    async def _play_tools(self, episode: Episode, state: _EnvEpisode) -> TrajectoryFinish:
        action, session = state.action, state.session
        assert action is not None and session is not None
        while True:  # the episode ends it at a turn limit, or a turn cut short (length)
            step = await episode.assistant_turn()
            calls = step.parsed.calls
            if not calls:
                return TrajectoryFinish.STOP
            episode.check_tool_turn(calls)
            results, malformed = [], False
            for k, call in enumerate(calls):
                if state.done:  # the episode ended at an earlier call of this turn
                    episode.counts["tool_calls_unexecuted"] += len(calls) - k
                    break
                shown, error, reward = await self._call(episode, state, step.turn, call)
                # the step's reward is on the turn already (_reward, by environment.openenv.reward)
                malformed |= episode.record_tool_call(step.index, CallOutcome(call, shown, error, reward), turn_reward=False)
                results.append(call.result_message(episode.truncate_tool_text(shown)))
            if state.done:
                return TrajectoryFinish.STOP
            if malformed:
                episode.apply_malformed_policy(step.turn)
            episode.observe(results, "tool")

    async def _call(self, episode: Episode, state: _EnvEpisode, turn: Turn, call: ParsedCall) -> tuple[str, str | None, float | None]:
        """One tool call as one ``step``: (what the model is shown, error kind, step reward)."""
        action, session = state.action, state.session
        assert action is not None and session is not None
        if call.error is not None:
            return f"Error: {call.detail}", call.error, None
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in self._tools(state)}
        if call.name not in tools:
            return f"Error: unknown tool {call.name!r} (available: {', '.join(tools)})", "unknown_tool", None
        arguments = call.arguments or {}
        problem = schema_problem(call.name, tools[call.name], arguments)
        if problem is not None:
            return f"Error: {problem}", "invalid_arguments", None
        if action.mode == "mcp":
            outcome = await session.step({"type": "call_tool", "tool_name": call.name, "arguments": arguments})
            self._reward(episode, state, turn, outcome)
            shown, tool_error = mcp_result(outcome.observation)
            # the environment's tool raised or refused: told to the model, as agentrl's own tools are
            return shown, (None if tool_error is None else "tool_exception"), outcome.reward
        outcome = await session.step(arguments)
        self._reward(episode, state, turn, outcome)
        shown = self._observation(state, outcome)
        if state.failure is not None:
            raise state.failure
        return shown, None, outcome.reward

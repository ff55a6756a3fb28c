"""``verifiers_env``: a verifiers environment's own rollout code, against agentrl's endpoint.

The row's environment (``extra_info.environment``, else the config's ``environment``; library
``verifiers``) is built once per process (``agentrl.environments.verifiers.load``). Each
trajectory opens a session on agentrl's OpenAI-compatible endpoint and calls the environment's
``rollout(input, client, model, sampling_args)`` unchanged, with a verifiers client over that
session (``environment.verifiers.client``: ``chat``, verifiers' default client, or ``token``,
the token client prime-rl uses: ``logprobs``, ``return_token_ids``, ``/tokenize`` and
``/v1/chat/completions/tokens``). Whatever the environment's code does between calls (tools,
``env_response``, stop conditions, its own timeout) is its own; the endpoint merges the calls
into the engine's exact token stream (``agent_loops/openai_agent.py`` does the same for agent
programs).

Rewards are the environment's rubric: the weighted sum is the trajectory reward, each reward
function and metric is logged as ``env/<name>``, and a step reward the environment set during
the rollout (``state["trajectory"][i]["reward"]``) becomes the turn reward of the assistant turn
that step sampled. A rubric with group-level reward functions is scored when the whole group
has finished (``finish_group``, called by ``RolloutRunner``), as ``Environment.run_group``
scores it; otherwise each trajectory is scored when it ends (``Rubric.score_group`` of one,
which never differs from scoring it alone).

The environment's failures end the trajectory with ``environment_error`` (kept, counted in
``env_errors/<kind>``, out of the loss): an error its rollout recorded (``state["error"]``: a
``vf.Error`` such as a tool error it stops on) and an exception its code raised (``exception``).
The endpoint's own failure, a request it refused and a transport error are ``loop_error``; a
limit of agentrl's (turns, response budget, the trajectory timeout) ends it as in every loop.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import Any

from agentrl.agent.loop import AgentLoop, LoopContext
from agentrl.agent.openai_endpoint import MODEL_NAME, EndpointSession, endpoint
from agentrl.agent.openai_wire import is_transport_error
from agentrl.config.schema import VerifiersEnvironmentConfig
from agentrl.data.row import Row
from agentrl.environments.verifiers import final_messages, load, rollout_input
from agentrl.errors import PluginError
from agentrl.trajectory import Trajectory, TrajectoryFinish


@dataclass(slots=True)
class _Waiting:
    """A trajectory whose group is scored together: its environment and verifiers state."""

    env: Any
    state: Any
    trajectory: Trajectory


def _error_kind(error: BaseException) -> str:
    """A verifiers error's kind: its class name (``ToolCallError``, ``SandboxError``, ...)."""
    return type(error).__name__


class VerifiersEnvLoop(AgentLoop):
    name = "verifiers_env"

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], _Waiting] = {}

    async def run(
        self, row: Row, ctx: LoopContext, *, row_id: str, group_id: str, sample_index: int = 0, seed: int | None = None
    ) -> Trajectory:
        ref = ctx.environment_ref(row)
        if ref is None or ref.library != "verifiers":
            raise PluginError(f"row {row_id!r}: the verifiers_env loop needs a verifiers environment "
                              "(extra_info.environment or environment.library=verifiers with environment.name)")
        env = load(ref)
        session = EndpointSession.for_trajectory(ctx, self.name, row_id=row_id, sample_index=sample_index, seed=seed)
        server = endpoint()
        base_url, api_key = server.open_session(session)
        settings: VerifiersEnvironmentConfig = ctx.environment.verifiers
        client = _client(base_url, api_key, settings.client)
        state: Any = None
        finish: TrajectoryFinish | None = None
        error: str | None = None
        kind: str | None = None
        inp = rollout_input(row, example_id=int(row.extra_info.index or 0))
        try:
            rollout = env.rollout(inp, client, MODEL_NAME, copy.deepcopy(env.sampling_args))
            state = await asyncio.wait_for(rollout, ctx.limits.trajectory_timeout_s)
        except asyncio.TimeoutError:
            finish = session.finish or TrajectoryFinish.TRAJECTORY_TIMEOUT
        except Exception as exc:  # the environment's code raised out of its rollout
            finish, error = _failure(exc, session)
            kind = "exception" if finish is TrajectoryFinish.ENVIRONMENT_ERROR else None
        finally:
            server.close_session(base_url)
            await client.close()
        if finish is None:
            finish, error, kind = _outcome(state, session)
        step_rewards = [step.get("reward") for step in state["trajectory"]] if state is not None else []
        trajectory = _trajectory(row, ctx, session, finish, error, kind, step_rewards, self.name,
                                 row_id=row_id, group_id=group_id, sample_index=sample_index)
        # the environment's final reply ends the messages (how the episode ended); the token
        # stream ends with the last answer: nothing after it is trained on
        trajectory.messages = [*trajectory.messages, *final_messages(state)]
        if state is None:
            return trajectory
        if finish in (TrajectoryFinish.ENVIRONMENT_ERROR, TrajectoryFinish.LOOP_ERROR):  # not scored; released
            await env.rubric.cleanup(state)
            return trajectory
        if env.rubric.has_group_rewards:  # scored with its group (finish_group)
            self._waiting[(group_id, sample_index)] = _Waiting(env, state, trajectory)
        else:
            await _score(env, [state], [trajectory])
        return trajectory

    async def finish_group(self, group: list[Trajectory]) -> None:
        """Score the group's trajectories together (the rubric's group-level reward functions see
        every member that ran to an end; failed members are left out, as their rewards are)."""
        waiting = [w for t in group if (w := self._waiting.pop((t.group_id, t.sample_index), None)) is not None]
        if waiting:
            await _score(waiting[0].env, [w.state for w in waiting], [w.trajectory for w in waiting])


def _client(base_url: str, api_key: str, kind: str) -> Any:
    import openai
    from verifiers.clients import OpenAIChatCompletionsClient, OpenAIChatCompletionsTokenClient

    raw = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return (OpenAIChatCompletionsTokenClient if kind == "token" else OpenAIChatCompletionsClient)(raw)


def _failure(exc: BaseException, session: EndpointSession) -> tuple[TrajectoryFinish, str]:
    own = f"{type(exc).__name__}: {exc}"
    if session.finish is not None:
        return session.finish, session.error or own
    if session.crashed is not None or session.refused is not None or is_transport_error(exc):
        why = session.crashed or session.refused
        return TrajectoryFinish.LOOP_ERROR, f"the endpoint failed or refused a request: {why} ({own})" if why else own
    return TrajectoryFinish.ENVIRONMENT_ERROR, own


def _outcome(state: Any, session: EndpointSession) -> tuple[TrajectoryFinish, str | None, str | None]:
    """How a rollout that returned ended: (finish, error, error kind)."""
    if session.finish is not None:  # a limit or the engine (its refusal became the state's error)
        return session.finish, session.error, None
    err = state.get("error")
    if err is not None:
        finish, text = _failure(err, session)
        return finish, text, _error_kind(err) if finish is TrajectoryFinish.ENVIRONMENT_ERROR else None
    if state.get("timed_out"):  # the environment's own timeout_seconds: its rollout, scored
        return TrajectoryFinish.TRAJECTORY_TIMEOUT, None, None
    if session.calls and session.calls[-1].finish_reason == "length":
        return TrajectoryFinish.LENGTH, None, None
    return TrajectoryFinish.STOP, None, None


async def _score(env: Any, states: list[Any], trajectories: list[Trajectory]) -> None:
    """The rubric's rewards on ``trajectories``: reward, ``env/<name>`` metrics, cleanup."""
    if env.score_rollouts:
        await env.rubric.score_group(states)
    else:
        await env.rubric.dummy_score_group(states)
    for state, t in zip(states, trajectories):
        t.reward = float(state.get("reward") or 0.0)
        metrics = state.get("metrics") or {}
        t.metrics.update({f"env/{name}": float(value) for name, value in metrics.items()})
        t.reward_info.update({"env_reward": t.reward, **{f"env/{k}": float(v) for k, v in metrics.items()}})
        await env.rubric.cleanup(state)


def _trajectory(row: Row, ctx: LoopContext, session: EndpointSession, finish: TrajectoryFinish, error: str | None,
                kind: str | None, step_rewards: list[Any], loop_name: str, *, row_id: str, group_id: str,
                sample_index: int) -> Trajectory:
    if len(step_rewards) == len(session.calls):  # each step is one call: its reward judges that call's turn
        turns_by_segment = [[t for t in s.builder.turns if t.role == "assistant"] for s in session.segments]
        seen = [0] * len(session.segments)
        for call, reward in zip(session.calls, step_rewards):
            turn_index = seen[call.segment]
            seen[call.segment] += 1
            if reward is not None and turn_index < len(turns_by_segment[call.segment]):
                turns_by_segment[call.segment][turn_index].reward = float(reward)
    info: dict[str, Any] = {}
    if error:
        info["error"] = error
    metrics: dict[str, float] = {}
    if kind is not None:
        info["error_kind"] = kind
        metrics[f"env_errors/{kind}"] = 1.0
    return session.trajectory(row, ctx, agent_name=loop_name, row_id=row_id, group_id=group_id,
                              sample_index=sample_index, finish=finish, reward=0.0, info=info, metrics=metrics)

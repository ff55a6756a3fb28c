"""``trl_env``: a TRL environment class (``GRPOTrainer(environment_factory=Cls)``) as an agent loop.

The loop of rows whose environment is ``library: trl`` (``extra_info.environment``, else the
config's ``environment``). One instance per trajectory, ``reset(**row)``, its observation added
to the prompt, its public methods the model's tools through the ordinary tool-calling turns
(the token stream as ``tool_agent`` keeps it: sampled ids as the engine gave them, tool results
as the chat template's masked deltas), and the reward functions of ``environment.trl`` scored as
TRL scores them (``agentrl.environments.trl`` states the mapping): once per group, when its ``n``
samples have finished (``finish_group``), each argument a list over the group. The environment's
own failures (its constructor or ``reset`` raised, a reward function raised, no function gave a
score) end the trajectory as ``environment_error``: kept, counted, out of the loss.
"""

from __future__ import annotations

import dataclasses
import inspect

from agentrl.agent.loop import AgentLoop, Episode, LoopContext
from agentrl.agent.outcomes import FAILED
from agentrl.data.row import Message, Row
from agentrl.environments import trl
from agentrl.errors import PluginError
from agentrl.trajectory import Trajectory, TrajectoryFinish


@dataclasses.dataclass(slots=True)
class _Waiting:
    """A trajectory waiting for its group to be scored: its reward functions and reward call entry."""

    funcs: list[trl.RewardFunction]
    completion: trl.Completion
    trajectory: Trajectory
    ctx: LoopContext


class TrlEnvLoop(AgentLoop):
    name = "trl_env"

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], _Waiting] = {}  # (group id, sample index) until finish_group

    async def play(self, episode: Episode) -> TrajectoryFinish:
        while True:  # the episode ends it at a turn limit, or a turn cut short (length)
            step = await episode.assistant_turn()
            if not step.parsed.calls:
                return TrajectoryFinish.STOP
            outcomes = await episode.call_tools(step.index, step.parsed)
            # TRL's tool message: role tool, the tool's name, the result as text
            results = [{**o.call.result_message(episode.truncate_tool_text(o.text)), "name": o.call.name or ""} for o in outcomes]
            episode.observe(results, "tool")

    async def run(self, row: Row, ctx: LoopContext, *, row_id: str, group_id: str, sample_index: int = 0,
                  seed: int | None = None) -> Trajectory:
        ref = ctx.environment_ref(row)
        if ref is None or ref.library != "trl":
            raise PluginError(f"the trl_env loop runs rows whose environment is a TRL class (library trl), "
                              f"not {'no environment' if ref is None else ref.library}")
        factory = trl.environment_class(ref)
        funcs = trl.reward_functions(ctx.environment.trl, factory if isinstance(factory, type) else None)
        columns = trl.reset_kwargs(row)
        try:
            env = factory(**ref.args)
            observation = env.reset(**columns)
            if inspect.isawaitable(observation):
                observation = await observation
            messages = trl.first_prompt(row.messages(), observation)
            box = trl.tool_box(env, max_parallel_calls=ctx.toolbox.max_parallel_calls, tool_timeout_s=ctx.toolbox.tool_timeout_s)
        except PluginError:
            raise  # the class cannot be offered (a tool without a schema): the run's problem, not this episode's
        except Exception as exc:
            return self._failed(row, ctx, row_id, group_id, sample_index, "reset", f"{type(exc).__name__}: {exc}")
        # TRL's reward functions replace agentrl's reward (reward.*) when there are any
        own = dataclasses.replace(ctx, toolbox=box, reward_fn=(lambda data_source: None) if funcs else ctx.reward_fn)
        prompted = row.model_copy(update={"prompt": [Message.model_validate(m) for m in messages]})
        traj = await super().run(prompted, own, row_id=row_id, group_id=group_id, sample_index=sample_index, seed=seed)
        # scored with its group (finish_group), as TRL calls the reward functions with its batch; a
        # member that failed (an engine, loop or interaction error, an abort) is out of the loss and out of
        # the call, so a function that ranks within its batch ranks the members that count
        if funcs and traj.finish_reason not in FAILED:
            completion = trl.Completion(messages, traj.messages[len(messages):], list(traj.response_ids), env, columns)
            self._waiting[(group_id, sample_index)] = _Waiting(funcs, completion, traj, ctx)
        return traj

    async def finish_group(self, group: list[Trajectory]) -> None:
        """One call of each reward function over the group's trajectories, in sample order (the
        members that played their episode to an end: one whose reset failed has no completion to
        score, one that failed later is out of the loss, as verifiers' group rubrics leave it out)."""
        waiting = [w for t in group if (w := self._waiting.pop((t.group_id, t.sample_index), None)) is not None]
        if not waiting:
            return
        try:
            scores = await trl.score_group(waiting[0].funcs, [w.completion for w in waiting],
                                           global_step=waiting[0].ctx.policy_version)
        except Exception as exc:  # the environment's code raised: no member of the group is scored
            for w in waiting:
                self._mark_failed(w.trajectory, "reward_function", f"a reward function raised {type(exc).__name__}: {exc}")
            return
        for w, (total, values) in zip(waiting, scores):
            self._credit(w.trajectory, total, values, w.ctx)

    def _credit(self, traj: Trajectory, total: float | None, values: dict[str, float], ctx: LoopContext) -> None:
        traj.metrics.update({f"env/{name}": value for name, value in values.items()})
        if total is None:
            self._mark_failed(traj, "unscored", "every reward function returned None (TRL: an unscorable completion)")
            return
        traj.reward_info.update({f"env/{name}": value for name, value in values.items()})
        weights = ctx.reward_components  # reward.components: the functions' weighted sum is the score
        if not weights.is_score_only:
            traj.reward_info["score"] = total
        traj.reward = weights.total(total, {}, None)

    @staticmethod
    def _mark_failed(traj: Trajectory, kind: str, error: str) -> None:
        traj.metrics[f"env_errors/{kind}"] = 1.0
        if traj.finish_reason not in FAILED:  # an earlier failure stays the reason
            traj.finish_reason = TrajectoryFinish.ENVIRONMENT_ERROR
            traj.reward_info["error"] = error
        traj.reward = 0.0

    def _failed(self, row: Row, ctx: LoopContext, row_id: str, group_id: str, sample_index: int, kind: str, error: str) -> Trajectory:
        return Trajectory(
            row_id=row_id, group_id=group_id, sample_index=sample_index, data_source=row.data_source, agent_name=self.name,
            prompt_ids=[], response_ids=[], response_mask=[], logprobs=[], turns=[], messages=row.messages(),
            finish_reason=TrajectoryFinish.ENVIRONMENT_ERROR, reward=0.0, reward_info={"error": f"{kind} failed: {error}"},
            metrics={f"env_errors/{kind}": 1.0}, policy_version=ctx.policy_version, ground_truth=row.ground_truth,
        )

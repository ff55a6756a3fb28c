"""``RolloutRunner``: many trajectories in flight on one asyncio loop.

Each row is run ``n`` times (one group: GRPO/RLOO compare the samples of a row); the loop is
chosen per row by ``agent_name`` (verl's names accepted), else by the library of the row's
environment (``extra_info.environment``, else the config's ``environment``: verifiers ->
``verifiers_env``, openenv -> ``openenv_env``, trl -> ``trl_env``), else the configured default.
Trajectories come back in a deterministic order (row order, then sample index), each with its
own seed derived from (seed, group, sample), so results do not depend on scheduling. A loop
that judges a group together (``AgentLoop.finish_group``) gets the whole group once its last
sample finishes, before ``on_done`` sees any of it. A loop
that raises does not lose its trajectory silently: it comes back with ``finish_reason``
``TrajectoryFinish.LOOP_ERROR`` and the error in ``reward_info`` (the trainer counts and drops
those).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import zlib
from typing import Any, Callable, Iterable, Sequence, cast

from agentrl.agent.families import detect_tool_parser, family_renderer, stop_tokens
from agentrl.agent.loop import AgentLoop, LoopContext, RewardFn
from agentrl.agent.setup import RolloutSetup
from agentrl.agent.tools_runtime import InteractionPool, ToolBox
from agentrl.config.schema import RewardConfig
from agentrl.data.row import Row
from agentrl.engines.base import Engine
from agentrl.engines.policies import serves
from agentrl.errors import ConfigError, PluginError
from agentrl.plugins import PluginRegistry
from agentrl.rewards import data_source_reward, resolve_reward
from agentrl.trajectory import Trajectory, TrajectoryFinish

__all__ = ["RolloutRunner", "LoopTable", "RewardTable", "check_agent_names", "check_row_plugins", "build_context", "finish_group",
           "judges_groups"]


class LoopTable:
    """Agent loops by name, each constructed once (from the ``agentrl.agent_loops`` group)."""

    def __init__(self, default: str, registry: PluginRegistry | None = None):
        self.registry = registry or PluginRegistry()
        self.default = self.registry.canonical("agent_loops", default)
        self._loops: dict[str, AgentLoop] = {}

    def get(self, name: str | None) -> AgentLoop:
        key = self.registry.canonical("agent_loops", name or self.default)
        if key not in self._loops:
            cls = self.registry.load("agent_loops", key)
            loop = cls() if isinstance(cls, type) else cls
            if not isinstance(loop, AgentLoop):
                raise PluginError(f"agent loop plugin {key!r} must be an agentrl.agent.loop.AgentLoop subclass")
            self._loops[key] = loop
        return self._loops[key]


def check_agent_names(names: Iterable[str | None], registry: PluginRegistry | None = None) -> list[str]:
    """Problems with the ``agent_name``s a dataset uses (checked when it loads, before generation)."""
    registry = registry or PluginRegistry()
    accepted = registry.accepted_names("agent_loops")
    installed = ", ".join(registry.names("agent_loops"))
    return [f"unknown agent_name {name!r} (known loops: {installed})" for name in sorted({n for n in names if n}) if name not in accepted]


def check_row_plugins(row: Row, registry: PluginRegistry | None = None) -> list[tuple[str, str]]:
    """``(field, problem)`` for each plugin a row names that is not installed or fails to import:
    its agent loop, its tools (the keys of ``extra_info.tools_kwargs``), its interaction and its
    agent program (``extra_info.agent_program``)."""
    from agentrl.data.dataset import row_plugin_problems  # pyarrow: only where rows are checked

    registry = registry or PluginRegistry()
    return list(row_plugin_problems(
        row, registry.accepted_names("agent_loops"), registry.names("tools"), registry.names("interactions"),
        registry.import_problem, agents=registry.names("agents"),
    ))


class RewardTable:
    """Reward functions by data source, resolved once each: ``reward.by_data_source``, else the
    reward a plugin package declares for the data source (``agentrl.data_source_rewards``), else
    ``reward.default`` (plugins of the ``agentrl.rewards`` group)."""

    def __init__(self, config: RewardConfig, prefer: dict[str, dict[str, str]] | None = None):
        self.config = config
        self.prefer = prefer
        self._by_name: dict[str, RewardFn] = {}
        self._by_source: dict[str, RewardFn] = {}

    def __call__(self, data_source: str) -> RewardFn:
        if data_source not in self._by_source:
            self._by_source[data_source] = self._resolve(data_source)
        return self._by_source[data_source]

    def _resolve(self, data_source: str) -> RewardFn:
        name = self.config.by_data_source.get(data_source)
        if name is None:
            declared = data_source_reward(data_source, self.prefer)
            if declared is not None:
                return self._with_format_score(declared)
            name = self.config.default
        if name not in self._by_name:
            self._by_name[name] = self._with_format_score(resolve_reward(name, self.prefer))
        return self._by_name[name]

    def _with_format_score(self, fn: RewardFn) -> RewardFn:
        if "format_score" not in inspect.signature(fn).parameters:
            return fn
        format_score, takes_format_score = self.config.format_score, cast(Any, fn)
        return lambda ds, sol, gt, extra: takes_format_score(ds, sol, gt, extra, format_score=format_score)


def build_context(
    engine: Engine, tokenizer: Any, setup: RolloutSetup, *, validation: bool = False, tool_names: Sequence[str] | None = None
) -> LoopContext:
    """The ``LoopContext`` of a setup (tools and parsers constructed here, once); ``tool_names``
    replaces the setup's tools (replay re-runs construct the tools its stored rows name)."""
    registry = PluginRegistry(setup.plugin_prefer)
    toolbox = ToolBox.from_plugins(
        list(tool_names if tool_names is not None else setup.tool_names), setup.tool_config,
        registry=registry, max_parallel_calls=setup.max_parallel_calls, tool_timeout_s=setup.tool_timeout_s,
        specs=setup.tool_specs,
    )
    renderer = family_renderer(tokenizer, template_kwargs=setup.chat_template_kwargs)
    parser_name = detect_tool_parser(tokenizer, renderer.chat_template) if setup.tool_parser == "auto" else setup.tool_parser
    if setup.default_loop == "tool_agent" and toolbox.tools and renderer.tool_message_problem is not None:
        raise ConfigError([("agent.default_loop", (
            f"tool_agent shows tool results through the chat template, and this one cannot: {renderer.tool_message_problem}. "
            "Use agent.default_loop=react (tool results as text in the conversation) or a chat template that renders role 'tool'"
        ))])
    unserved = [role for role, policy in setup.roles.items() if policy == "trained" and not serves(engine, role)]
    if unserved:  # before any rollout: a trained role's turns would otherwise fail one by one
        raise ConfigError([(f"agent.roles.{role}", "trained: no engine here serves the role's own policy (agentrl train "
                            "builds one; elsewhere use shared or frozen, docs/roles.md)") for role in unserved])
    sampling = setup.val_sampling if validation else setup.sampling
    if not sampling.stop_token_ids:  # end-of-turn, eos and generation_config eos ids of the family
        sampling = dataclasses.replace(sampling, stop_token_ids=stop_tokens(tokenizer, renderer).ids)
    return LoopContext(
        engine=engine,
        renderer=renderer,
        parser=registry.load("tool_parsers", parser_name)(),
        parser_by_loop={
            registry.canonical("agent_loops", loop): registry.load("tool_parsers", parser)()
            for loop, parser in setup.tool_parser_by_loop.items()
        },
        history=setup.history,
        history_by_loop={registry.canonical("agent_loops", loop): policy for loop, policy in setup.history_by_loop.items()},
        toolbox=toolbox,
        interactions=InteractionPool(setup.interaction_config, registry, specs=setup.interaction_specs,
                                     timeout_s=setup.tool_timeout_s),
        limits=setup.limits,
        sampling=sampling,
        reward_fn=RewardTable(setup.reward, registry.prefer),
        roles=dict(setup.roles),
        reward_components=setup.reward.components,
        environment=setup.environment,
    )


class RolloutRunner:
    def __init__(self, ctx: LoopContext, loops: LoopTable, *, max_concurrency: int = 256):
        self.ctx = ctx
        self.loops = loops
        self.max_concurrency = max_concurrency
        self.inflight = 0
        self.inflight_max = 0

    async def run(
        self,
        rows: Sequence[tuple[str, Row]],
        *,
        n: int = 1,
        group_prefix: str = "",
        seed: int | None = 0,
        progress: bool | str = False,
        on_done: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Run every row ``n`` times; returns trajectories in (row, sample) order.

        ``max_concurrency`` workers pull (row, sample) jobs in order, so memory stays bounded by
        the trajectories in flight however many rows there are.
        """
        total = len(rows) * n
        bar = _progress_bar(total, progress)
        results: list[list[Trajectory] | None] = [None] * total  # a loop with roles gives one per role
        left = [n] * len(rows)  # per row: samples still running (a loop with finish_group waits for them)
        jobs = iter(range(total))

        async def worker() -> None:
            for slot in jobs:  # a shared iterator: each job is taken by exactly one worker
                i, sample = divmod(slot, n)
                row_id, row = rows[i]
                self.inflight += 1
                self.inflight_max = max(self.inflight_max, self.inflight)
                try:
                    results[slot] = await self._run_one(row_id, row, f"{group_prefix}{i}:{row_id}", sample, seed)
                finally:
                    self.inflight -= 1
                done = list(results[slot] or [])
                loop = self.loops.get(row.loop_name(self.ctx.default_environment))
                if judges_groups(loop):  # the group is handed on whole
                    left[i] -= 1
                    done = [t for k in range(n) for t in results[i * n + k] or []] if left[i] == 0 else []
                    if done:
                        await finish_group(loop, done)
                for t in done:
                    if on_done is not None:
                        on_done(t)
                if bar is not None:
                    bar.update(1)

        try:
            await asyncio.gather(*(worker() for _ in range(min(self.max_concurrency, total))))
        finally:
            if bar is not None:
                bar.close()
        return [t for ts in results for t in ts or []]

    async def _run_one(self, row_id: str, row: Row, group_id: str, sample: int, seed: int | None) -> list[Trajectory]:
        loop = self.loops.get(row.loop_name(self.ctx.default_environment))
        traj_seed = None if seed is None else zlib.crc32(f"{seed}|{group_id}|{sample}".encode()) & 0x7FFFFFFF
        try:
            done = await loop.run(row, self.ctx, row_id=row_id, group_id=group_id, sample_index=sample, seed=traj_seed)
            return done if isinstance(done, list) else [done]  # a RolesLoop (agentrl.agent.roles): one per role
        except Exception as exc:  # recorded, never silently missing
            return [Trajectory(
                row_id=row_id, group_id=group_id, sample_index=sample, data_source=row.data_source,
                agent_name=loop.name, prompt_ids=[], response_ids=[], response_mask=[], logprobs=[], turns=[],
                messages=row.messages(), finish_reason=TrajectoryFinish.LOOP_ERROR, reward=0.0,
                reward_info={"error": f"{type(exc).__name__}: {exc}"}, policy_version=self.ctx.policy_version,
                ground_truth=row.ground_truth,
            )]


def judges_groups(loop: AgentLoop) -> bool:
    """Whether the loop overrides ``AgentLoop.finish_group`` (its rewards judge a group together)."""
    return type(loop).finish_group is not AgentLoop.finish_group


async def finish_group(loop: AgentLoop, group: list[Trajectory]) -> None:
    """The loop's ``finish_group`` (``RolloutRunner`` and ``agentrl replay rerun`` call it); when
    it raises, the group's trajectories become ``loop_error`` (kept, with the error, out of the
    loss) rather than unscored."""
    try:
        await loop.finish_group(group)
    except Exception as exc:
        for t in group:
            t.finish_reason = TrajectoryFinish.LOOP_ERROR
            t.reward_info["error"] = f"finishing the group failed: {type(exc).__name__}: {exc}"


def _progress_bar(total: int, progress: bool | str) -> Any:  # a tqdm bar or None
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=progress if isinstance(progress, str) else "rollout", unit="traj", leave=False)

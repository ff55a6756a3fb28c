"""``RolloutSetup``: the typed seam between the validated config and the agent loops.

The trainer builds one ``RolloutSetup`` from the config (``RolloutSetup.from_config``) and hands
it, whole, to the process that hosts the engine (a Ray actor: the object pickles); ``agentrl
rollout`` and replay build theirs the same way. ``agentrl.agent.runner.build_context`` turns it
into the ``LoopContext`` the loops read. Nothing here has a default of its own: every value comes
from the config schema, the one place defaults live.

Following ``agent.max_assistant_turns`` from the command line: ``config/loader.py`` validates it
against ``config/schema.py`` (``AgentConfig``), ``Limits.from_config`` below copies it, and
``Episode.check_turn`` in ``agent/loop.py`` is the one place it is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.config.schema import AgentConfig, EnvironmentConfig, RewardConfig, RolloutConfig, TrainConfig
from agentrl.config.verl_files import InteractionSpec, ToolSpec, read_interaction_config, read_tool_config
from agentrl.engines.base import SamplingParams
from agentrl.engines.process import default_engine_threads

__all__ = ["Limits", "RolloutSetup"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one episode may spend; checked by the episode on every append (see ``Episode``)."""

    max_assistant_turns: int
    max_user_turns: int
    max_response_tokens: int  # the whole response, sampled and observed
    max_new_tokens: int  # per assistant turn
    max_tool_response_tokens: int
    trajectory_timeout_s: float
    malformed_call_policy: Literal["feedback", "penalize", "end"]
    malformed_call_penalty: float
    program_error_reward: float  # openai_agent: an episode whose program raised

    @classmethod
    def from_config(cls, agent: AgentConfig, rollout: RolloutConfig, *, max_response_tokens: int) -> "Limits":
        return cls(
            max_assistant_turns=agent.max_assistant_turns,
            max_user_turns=agent.max_user_turns,
            max_response_tokens=max_response_tokens,
            max_new_tokens=rollout.max_new_tokens,
            max_tool_response_tokens=agent.max_tool_response_tokens,
            trajectory_timeout_s=agent.trajectory_timeout_s,
            malformed_call_policy=agent.malformed_call_policy,
            malformed_call_penalty=agent.malformed_call_penalty,
            program_error_reward=agent.program_error_reward,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutSetup:
    """Everything needed to host an engine and run the agent loops, built once from the config."""

    limits: Limits
    sampling: SamplingParams  # training rollouts (max_new_tokens and stop ids are set per turn)
    val_sampling: SamplingParams  # validation rollouts
    default_loop: str  # for rows without an agent_name
    tool_parser: str  # the parser of every loop not named in tool_parser_by_loop
    tool_parser_by_loop: dict[str, str]
    chat_template_kwargs: dict[str, Any]  # extra chat-template variables (e.g. enable_thinking)
    history: Literal["as_sampled", "as_template"]  # agent.history: what each request shows the model
    history_by_loop: dict[str, Literal["as_sampled", "as_template"]]
    roles: dict[str, str]  # agent.roles: role -> policy, over a RolesLoop's own (agentrl.agent.roles)
    tool_names: tuple[str, ...]  # the tools constructed once per context (offered to rows that name none)
    tool_config: dict[str, dict[str, Any]]  # constructor kwargs by tool name
    tool_specs: tuple[ToolSpec, ...]  # the tools of agent.tool_config_path (verl's YAML)
    interaction_config: dict[str, dict[str, Any]]
    interaction_specs: tuple[InteractionSpec, ...]  # the interactions of agent.interaction_config_path
    max_parallel_calls: int
    tool_timeout_s: float
    reward: RewardConfig
    plugin_prefer: dict[str, dict[str, str]]  # plugins.prefer: which distribution wins a name
    max_concurrency: int  # trajectories in flight
    engine_max_batch_size: int  # builtin engine: sequences decoded together
    engine_decode_graphs: bool | None  # builtin engine: CUDA-graph decode steps (None: on for CUDA)
    seed: int  # the builtin engine's sampling generator
    weight_sync: Literal["memory", "disk"]  # how the trainer's weights reach a colocated engine
    weights_dir: str | None  # the checkpoint directory of weight_sync=disk (set by the trainer)
    # which engine the loops drive: the builtin engine in the hosting process, or SGLang servers
    # (``server_urls``, managed or external: ``engines/managed.py``) through ``SGLangEngine``
    engine_backend: Literal["builtin", "sglang", "scripted"]
    server_urls: tuple[str, ...]
    request_timeout_s: float  # sglang: one /generate call
    max_retries: int  # sglang: transport errors and 5xx, per server
    api_key: str | None = field(repr=False)  # sglang: the servers' key (managed: their launch's; external: $AGENTRL_API_KEY)
    # rollout.max_staleness: > 0 rolls out on a thread of its own while the trainer trains (docs/training.md, Asynchronous training)
    max_staleness: int
    # rollout.partial: a weight update interrupts running requests, which resume under the new weights
    partial: bool
    sync_timeout_s: float  # engine.sync_timeout_s: the longest one weight sync may take
    engine_process: bool  # builtin engine: in a process of its own (engine.process, resolved)
    engine_threads: int  # builtin engine in its own process: its torch threads (engine.threads, resolved here)
    # the config's environment section: the ref of rows that name none, and each library's settings
    environment: EnvironmentConfig

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, weights_dir: str | None = None, server_urls: tuple[str, ...] = (),
                    api_key: str | None = None) -> "RolloutSetup":
        """The setup of a validated config; ``weights_dir`` is where ``engine.weight_sync=disk``
        writes the policy for the engine (the trainer's run directory; unused without a trainer);
        ``server_urls``: the SGLang servers of ``engine=sglang`` (the config's external ones by default)."""
        agent, rollout, engine = cfg.agent, cfg.rollout, cfg.engine
        tool_specs = tuple(read_tool_config(agent.tool_config_path)) if agent.tool_config_path else ()
        interaction_specs = tuple(read_interaction_config(agent.interaction_config_path)) if agent.interaction_config_path else ()
        # SGLang servers are other processes: the disk sync is the one path that reaches them on a CPU
        disk = engine.weight_sync == "disk" or engine.backend == "sglang"
        weight_sync: Literal["memory", "disk"] = "disk" if disk else "memory"
        # empty for managed servers not started yet (replay re-runs build a setup without an engine)
        urls = tuple(server_urls or engine.servers)
        return cls(
            limits=Limits.from_config(agent, rollout, max_response_tokens=cfg.data.max_response_length),
            sampling=SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k),
            val_sampling=SamplingParams(temperature=rollout.val_temperature, top_p=rollout.top_p, top_k=rollout.top_k),
            default_loop=agent.default_loop,
            tool_parser=agent.tool_parser,
            tool_parser_by_loop=dict(agent.tool_parser_by_loop),
            chat_template_kwargs=dict(agent.chat_template_kwargs),
            history=agent.history,
            history_by_loop=dict(agent.history_by_loop),
            roles=dict(agent.roles),
            # offered to rows whose tools_kwargs name none: the configured tools only (verl offers
            # none unless its tool YAML names some); rows that name tools get those
            tool_names=tuple(dict.fromkeys([s.name for s in tool_specs] + list(agent.tool_config))),
            tool_config={k: dict(v) for k, v in agent.tool_config.items()},
            tool_specs=tool_specs,
            interaction_config={k: dict(v) for k, v in agent.interaction_config.items()},
            interaction_specs=interaction_specs,
            max_parallel_calls=agent.max_parallel_calls,
            tool_timeout_s=agent.tool_timeout_s,
            reward=cfg.reward.model_copy(deep=True),
            plugin_prefer={k: dict(v) for k, v in cfg.plugins.prefer.items()},
            max_concurrency=rollout.max_concurrency,
            engine_max_batch_size=cfg.engine.max_batch_size,
            engine_decode_graphs=cfg.engine.decode_graphs,
            seed=cfg.trainer.seed,
            weight_sync=weight_sync,
            weights_dir=weights_dir,
            engine_backend=engine.backend,
            server_urls=urls,
            request_timeout_s=cfg.engine.request_timeout_s,
            max_retries=cfg.engine.max_retries,
            api_key=api_key,
            max_staleness=rollout.max_staleness,
            partial=rollout.partial,
            sync_timeout_s=cfg.engine.sync_timeout_s,
            engine_process=engine.process if engine.process is not None else rollout.max_staleness > 0,
            engine_threads=engine.threads or default_engine_threads(),
            environment=cfg.environment.model_copy(deep=True),
        )

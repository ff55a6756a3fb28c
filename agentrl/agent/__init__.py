"""The agent layer: loops, episodes, tools and interactions at run time, the runner.

What a plugin author or a caller needs, importable from here (none of these modules imports
torch or transformers at import time; a test checks it)::

    from agentrl.agent import AgentLoop, Episode, EpisodeEnd, RolloutRunner, ScriptedEngine, build_context

Write a loop by subclassing ``AgentLoop`` and implementing ``play(episode) -> finish reason``;
test it with ``ScriptedEngine`` (answers from a script, no model). See ``loop.py`` for the
limits and finish reasons, ``render.py`` for how the token stream stays exact.
"""

from __future__ import annotations

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.agent.loop import AgentLoop, AssistantTurn, Episode, EpisodeEnd, Limits, LoopContext, ask_interaction
from agentrl.agent.families import TemplateReport, check_template, detect_tool_parser, stop_tokens
from agentrl.agent.program import AgentResult, AgentTask
from agentrl.agent.render import ChatRenderer, TemplateUnsupported
from agentrl.agent.roles import RolesEpisode, RolesLoop, role_group_id
from agentrl.agent.runner import LoopTable, RewardTable, RolloutRunner, build_context, check_agent_names, check_row_plugins
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tool_parsers import (
    DeepSeekR1ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ParsedTurn,
    Phi4MiniToolParser,
    ReactToolParser,
    ToolParser,
)
from agentrl.agent.tools_runtime import (
    CallOutcome,
    InteractionPool,
    InteractionSession,
    ToolBox,
    ToolSession,
    validate_arguments,
)

__all__ = [
    # loops
    "AgentLoop",
    "AssistantTurn",
    "Episode",
    "EpisodeEnd",
    "LoopContext",
    "Limits",
    "ask_interaction",
    # several agents in one episode (docs/roles.md)
    "RolesLoop",
    "RolesEpisode",
    "role_group_id",
    # agent programs behind the OpenAI endpoint (the openai_agent loop)
    "AgentTask",
    "AgentResult",
    # running many
    "RolloutRunner",
    "LoopTable",
    "RewardTable",
    "build_context",
    "check_agent_names",
    "check_row_plugins",
    "ScriptedEngine",
    "RolloutSetup",
    # tokens
    "ChatRenderer",
    "TemplateUnsupported",
    # model families: stops, native parsers, the template check
    "stop_tokens",
    "detect_tool_parser",
    "check_template",
    "TemplateReport",
    # tool calls
    "ToolParser",
    "ParsedCall",
    "ParsedTurn",
    "HermesToolParser",
    "ReactToolParser",
    "MistralToolParser",
    "Llama3JsonToolParser",
    "Phi4MiniToolParser",
    "DeepSeekR1ToolParser",
    # tools and interactions
    "Tool",
    "ToolResult",
    "Interaction",
    "InteractionResponse",
    "ToolBox",
    "ToolSession",
    "CallOutcome",
    "InteractionPool",
    "InteractionSession",
    "validate_arguments",
]

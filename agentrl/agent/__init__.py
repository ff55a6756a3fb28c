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
from agentrl.agent.loop import AgentLoop, Episode, EpisodeEnd, Limits, LoopContext, ask_interaction
from agentrl.agent.render import ChatRenderer
from agentrl.agent.runner import LoopTable, RewardTable, RolloutRunner, build_context, check_agent_names, check_row_plugins
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tool_parsers import HermesToolParser, ParsedCall, ParsedTurn, ReactToolParser, ToolParser
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
    "Episode",
    "EpisodeEnd",
    "LoopContext",
    "Limits",
    "ask_interaction",
    # running many
    "RolloutRunner",
    "LoopTable",
    "RewardTable",
    "build_context",
    "check_agent_names",
    "check_row_plugins",
    "ScriptedEngine",
    # tokens
    "ChatRenderer",
    # tool calls
    "ToolParser",
    "ParsedCall",
    "ParsedTurn",
    "HermesToolParser",
    "ReactToolParser",
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

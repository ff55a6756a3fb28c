"""The agent layer: loops, episodes, tools and interactions at run time, the runner.

What a plugin author or a caller needs, importable from here (lazily: ``import agentrl.agent``
pulls in neither torch nor transformers)::

    from agentrl.agent import AgentLoop, Episode, EpisodeEnd, RolloutRunner, ScriptedEngine, build_context

Write a loop by subclassing ``AgentLoop`` and implementing ``play(episode) -> finish reason``;
test it with ``ScriptedEngine`` (answers from a script, no model). See ``loop.py`` for the
limits and finish reasons, ``render.py`` for how the token stream stays exact.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # loops
    "AgentLoop": "agentrl.agent.loop",
    "Episode": "agentrl.agent.loop",
    "EpisodeEnd": "agentrl.agent.loop",
    "LoopContext": "agentrl.agent.loop",
    "Limits": "agentrl.agent.loop",
    "ask_interaction": "agentrl.agent.loop",
    # running many
    "RolloutRunner": "agentrl.agent.runner",
    "LoopTable": "agentrl.agent.runner",
    "RewardTable": "agentrl.agent.runner",
    "build_context": "agentrl.agent.runner",
    "check_agent_names": "agentrl.agent.runner",
    "check_row_plugins": "agentrl.agent.runner",
    "ScriptedEngine": "agentrl.agent.scripted",
    # tokens
    "ChatRenderer": "agentrl.agent.render",
    "TemplateUnsupported": "agentrl.agent.render",
    # model families: stops, native parsers, the template check
    "stop_tokens": "agentrl.agent.families",
    "detect_tool_parser": "agentrl.agent.families",
    "check_template": "agentrl.agent.families",
    "TemplateReport": "agentrl.agent.families",
    # tool calls
    "ToolParser": "agentrl.agent.tool_parsers",
    "ParsedCall": "agentrl.agent.tool_parsers",
    "ParsedTurn": "agentrl.agent.tool_parsers",
    "HermesToolParser": "agentrl.agent.tool_parsers",
    "ReactToolParser": "agentrl.agent.tool_parsers",
    "MistralToolParser": "agentrl.agent.tool_parsers",
    "Llama3JsonToolParser": "agentrl.agent.tool_parsers",
    "Phi4MiniToolParser": "agentrl.agent.tool_parsers",
    "DeepSeekR1ToolParser": "agentrl.agent.tool_parsers",
    # tools and interactions
    "Tool": "agentrl.agent.tool",
    "ToolResult": "agentrl.agent.tool",
    "Interaction": "agentrl.agent.interaction",
    "InteractionResponse": "agentrl.agent.interaction",
    "ToolBox": "agentrl.agent.tools_runtime",
    "ToolSession": "agentrl.agent.tools_runtime",
    "CallOutcome": "agentrl.agent.tools_runtime",
    "InteractionPool": "agentrl.agent.tools_runtime",
    "InteractionSession": "agentrl.agent.tools_runtime",
    "validate_arguments": "agentrl.agent.tools_runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

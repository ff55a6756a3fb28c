"""agentrl: train tool-using LLM agents with multi-turn reinforcement learning.

The public API is the names in ``__all__``; everything else is internal and may change.
Names are imported on first use, so ``import agentrl`` stays cheap (no torch, no Ray).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the four boundary objects
    "Row": "agentrl.data.row",
    "SamplingParams": "agentrl.engines.base",
    "GenerateRequest": "agentrl.engines.base",
    "GenerateResult": "agentrl.engines.base",
    "FinishReason": "agentrl.engines.base",
    "Trajectory": "agentrl.trajectory",
    "Turn": "agentrl.trajectory",
    "ToolCallRecord": "agentrl.trajectory",
    "TrajectoryBuilder": "agentrl.trajectory",
    # plugin APIs
    "Engine": "agentrl.engines.base",
    "Tool": "agentrl.agent.tool",
    "ToolResult": "agentrl.agent.tool",
    "Interaction": "agentrl.agent.interaction",
    "InteractionResponse": "agentrl.agent.interaction",
    "PluginRegistry": "agentrl.plugins",
    # configuration
    "TrainConfig": "agentrl.config.schema",
    "load_config": "agentrl.config.loader",
    # errors
    "AgentrlError": "agentrl.errors",
    "ConfigError": "agentrl.errors",
    "DataError": "agentrl.errors",
    "PluginError": "agentrl.errors",
    "EngineError": "agentrl.errors",
    "EngineUnavailable": "agentrl.errors",
    "EngineTimeout": "agentrl.errors",
    "ToolError": "agentrl.errors",
    "ToolArgumentError": "agentrl.errors",
    "TrajectoryError": "agentrl.errors",
    "CheckpointError": "agentrl.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__

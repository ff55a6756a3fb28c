"""agentrl: train tool-using LLM agents with multi-turn reinforcement learning.

The public API is the names in ``__all__``; everything else is internal and may change.
Every module imported here is free of torch and Ray (a test checks it), so ``import agentrl``
stays cheap: the engines and the trainer load torch when they are used.
"""

from __future__ import annotations

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.agent.loop import AgentLoop, Episode, EpisodeEnd
from agentrl.agent.program import AgentResult, AgentTask
from agentrl.agent.roles import RolesEpisode, RolesLoop
from agentrl.agent.runner import RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tool_parsers import ParsedCall, ParsedTurn, ToolParser
from agentrl.config.loader import load_config
from agentrl.config.schema import TrainConfig
from agentrl.data.io import write_rows
from agentrl.data.row import Row
from agentrl.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.errors import (
    AgentrlError,
    CheckpointError,
    ConfigError,
    DataError,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    EnvironmentFailure,
    NotAvailable,
    PluginError,
    ToolArgumentError,
    ToolError,
    TrajectoryError,
    WorkerDied,
)
from agentrl.plugins import PluginRegistry
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, TrajectorySegment, Turn

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # the four boundary objects
    "Row",
    "SamplingParams",
    "GenerateRequest",
    "GenerateResult",
    "FinishReason",
    "Trajectory",
    "Turn",
    "ToolCallRecord",
    "TrajectorySegment",
    "TrajectoryBuilder",
    # plugin APIs
    "Engine",
    "AgentLoop",
    "AgentTask",
    "AgentResult",
    "Episode",
    "EpisodeEnd",
    "RolesLoop",
    "RolesEpisode",
    "Tool",
    "ToolResult",
    "Interaction",
    "InteractionResponse",
    "ToolParser",
    "ParsedCall",
    "ParsedTurn",
    "PluginRegistry",
    # running and testing loops
    "RolloutRunner",
    "ScriptedEngine",
    # configuration
    "TrainConfig",
    "load_config",
    # data: a plugin's own data source
    "write_rows",
    # errors
    "AgentrlError",
    "ConfigError",
    "DataError",
    "PluginError",
    "EngineError",
    "EngineUnavailable",
    "EngineTimeout",
    "ToolError",
    "ToolArgumentError",
    "TrajectoryError",
    "EnvironmentFailure",
    "CheckpointError",
    "WorkerDied",
    "NotAvailable",
]

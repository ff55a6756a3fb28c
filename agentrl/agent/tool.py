"""The tool plugin API (entry point group ``agentrl.tools``).

Lifecycle, enforced by the agent layer:

* ``__init__(**config)`` once per worker process (never per sample): load resources here.
* per trajectory: ``create`` once, ``execute`` for each call, ``calc_reward`` at the end, and
  ``release`` ALWAYS - after errors and cancellation too.
* ``instance_id`` names the trajectory: its group id and sample index
  (``{purpose}{step}/{position}:{row id}#{sample}`` in training), the same in every process, so
  a tool may seed its per-trajectory randomness from it.

Arguments are validated against ``parameters`` (JSON Schema, OpenAI function format) before
``execute`` sees them, so ``execute`` can trust their shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Tool", "ToolResult"]


@dataclass(slots=True)
class ToolResult:
    text: str  # what the model is shown
    reward: float | None = None  # a step reward judging the call (placed on the calling turn)
    metrics: dict[str, float] = field(default_factory=dict)


class Tool:
    """Base class for tools. Subclasses set ``name``, ``description`` and ``parameters``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self, **config: Any) -> None:
        self.config = config

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The OpenAI function-calling schema, as chat templates render it."""
        return {
            "type": "function",
            "function": {"name": cls.name, "description": cls.description, "parameters": cls.parameters},
        }

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Start per-trajectory state (e.g. store the row's ground truth)."""

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        """A reward for the whole trajectory's use of this tool, or None."""
        return None

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free per-trajectory state. Called exactly once per ``create``, whatever happened."""

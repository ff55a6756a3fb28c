"""The ``shout`` tool: returns its text in capitals."""

from __future__ import annotations

from typing import Any

from agentrl import Tool, ToolResult


class ShoutTool(Tool):
    name = "shout"
    description = "Returns the text in capital letters."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.calls: dict[str, int] = {}  # per trajectory (instance id)

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self.calls[instance_id] = 0

    async def execute(self, instance_id: str, arguments: dict[str, Any], **kwargs: Any) -> ToolResult:
        self.calls[instance_id] += 1
        text = arguments["text"]
        # reward: a small step reward on the calling turn; metrics: averaged per step as tool/shout/chars
        return ToolResult(text=text.upper(), reward=0.1, metrics={"chars": float(len(text))})

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        # the end-of-trajectory judgement: did the trajectory use the tool at all
        return 1.0 if self.calls.get(instance_id) else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.calls.pop(instance_id, None)

"""``check_answer``: tells the model whether its answer equals the row's ground truth.

The ground truth comes from the row's ``tools_kwargs.check_answer.create_kwargs.ground_truth``.
Each check gives a step reward (1.0 correct, 0.0 not); ``calc_reward`` is 1.0 when the last
checked answer was correct.
"""

from __future__ import annotations

from typing import Any

from agentrl.agent.tool import Tool, ToolResult

__all__ = ["CheckAnswerTool"]


class CheckAnswerTool(Tool):
    name = "check_answer"
    description = "Check whether a final numeric answer is correct."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the final answer, a number"}},
        "required": ["answer"],
    }

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str, ground_truth: Any = None, **create_kwargs: Any) -> None:
        self._state[instance_id] = {"ground_truth": None if ground_truth is None else str(ground_truth), "last": 0.0}

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        state = self._state[instance_id]
        answer = str(arguments["answer"]).replace(",", "").replace("$", "").strip()
        correct = state["ground_truth"] is not None and answer == state["ground_truth"].replace(",", "")
        state["last"] = 1.0 if correct else 0.0
        return ToolResult(text="correct" if correct else "incorrect", reward=state["last"])

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        return self._state[instance_id]["last"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)

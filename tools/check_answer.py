"""``check_answer``: tells the model whether its answer equals the row's ground truth.

Like verl's GSM8K tool: the ground truth arrives per trajectory through ``create`` (the row's
``extra_info.tools_kwargs.check_answer.create_kwargs.ground_truth``), the model calls the tool
with ``{"answer": "..."}`` and is told ``correct`` or ``incorrect``.

Judging is ``agentrl.rewards.judge_number``, the rule of the ``exact_number`` reward: the last
``#### <number>`` of the answer, else its last number (so "#### 72" and "72 clips" both work),
equals the ground truth *as a number* (",", "$" and a trailing "." ignored; "72.0" is 72). So
the tool says "correct" exactly when ``exact_number`` scores the answer 1.0. This is kinder than
the strict GSM8K reward on purpose: the tool answers a question, the trajectory reward still
judges the format.

Rewards: every check gives a step reward of 1.0 (correct) or 0.0 (incorrect), placed by the
agent layer on the turn that made the call; ``calc_reward`` is 1.0 when the *last* checked
answer was correct, 0.0 when it was not or nothing was checked, and None when the trajectory
has no ground truth (nothing to judge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.agent.tool import Tool, ToolResult
from agentrl.errors import ToolError
from agentrl.rewards import judge_number

__all__ = ["CheckAnswerTool"]


@dataclass(slots=True)
class _Instance:
    ground_truth: str | None
    last_correct: bool = False


class CheckAnswerTool(Tool):
    """Answers ``correct`` / ``incorrect``; no configuration, state per trajectory."""

    name = "check_answer"
    description = "Check whether your final numeric answer is correct."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the final answer, a number"}},
        "required": ["answer"],
    }

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._instances: dict[str, _Instance] = {}

    async def create(self, instance_id: str, ground_truth: Any = None, **create_kwargs: Any) -> None:
        # No ground truth is not an error here: a row may enable every tool without using this
        # one. A call without one is answered with an error the model (and the metrics) see.
        self._instances[instance_id] = _Instance(None if ground_truth is None else str(ground_truth))

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise ToolError(f"check_answer has no instance {instance_id!r} (create was not called)")
        if instance.ground_truth is None:
            raise ToolError(
                "check_answer has no ground truth for this problem "
                "(the row needs extra_info.tools_kwargs.check_answer.create_kwargs.ground_truth)"
            )
        instance.last_correct = judge_number(str(arguments["answer"]), instance.ground_truth).correct
        reward = 1.0 if instance.last_correct else 0.0
        return ToolResult(text="correct" if instance.last_correct else "incorrect", reward=reward)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        instance = self._instances.get(instance_id)
        if instance is None or instance.ground_truth is None:
            return None
        return 1.0 if instance.last_correct else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

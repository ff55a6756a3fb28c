"""``check_answer``: tells the model whether its answer equals the row's ground truth.

Like verl's GSM8K tool: the ground truth arrives per trajectory through ``create`` (the row's
``extra_info.tools_kwargs.check_answer.create_kwargs.ground_truth``), the model calls the tool
with ``{"answer": "..."}`` and is told ``correct`` or ``incorrect``.

Judging: the last number in the answer (so "#### 72" and "72 clips" both work), with ``,``
and ``$`` removed, equals the ground truth *as a number* ("72.0" is 72). This is kinder than
the strict GSM8K reward on purpose: the tool answers a question, the trajectory reward still
judges the format.

Rewards: every check gives a step reward of 1.0 (correct) or 0.0 (incorrect), placed by the
agent layer on the turn that made the call; ``calc_reward`` is 1.0 when the *last* checked
answer was correct, 0.0 when it was not or nothing was checked, and None when the trajectory
has no ground truth (nothing to judge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from agentrl.agent.tool import Tool, ToolResult
from agentrl.errors import ToolError

__all__ = ["CheckAnswerTool", "same_number"]

_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def _last_number(text: str) -> Decimal | None:
    matches = _NUMBER.findall(text.replace("$", ""))
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


def same_number(answer: str, ground_truth: str) -> bool:
    """Whether the last number in ``answer`` equals ``ground_truth`` numerically."""
    got, want = _last_number(answer), _last_number(ground_truth)
    return got is not None and want is not None and got == want


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
        instance.last_correct = same_number(str(arguments["answer"]), instance.ground_truth)
        reward = 1.0 if instance.last_correct else 0.0
        return ToolResult(text="correct" if instance.last_correct else "incorrect", reward=reward)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        instance = self._instances.get(instance_id)
        if instance is None or instance.ground_truth is None:
            return None
        return 1.0 if instance.last_correct else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

"""``gsm8k_answer``: verl's GSM8K answer tool, behaviour for behaviour.

What verl's ``Gsm8kTool`` does, so that a verl tool YAML naming it trains the same thing here:

* the model calls the tool with ``{"answer": "..."}``; an answer without the ``#### `` prefix
  gets it, and the result is scored by verl's flexible GSM8K rule (the last number, compared as
  text with the ground truth: ``agentrl.rewards.gsm8k_flexible``);
* the model is shown ``Current parsed answer='72' reward=1.0``;
* the call's step reward is 0.0 when the score improved on the trajectory's best so far and
  -0.05 otherwise (verl's penalty for resubmitting without improving);
* ``calc_reward`` is the score of the last submitted answer (0.0 when nothing was submitted).

The ground truth arrives per trajectory through ``create`` (the row's
``extra_info.tools_kwargs.<tool name>.create_kwargs.ground_truth``). verl names the tool
``calc_gsm8k_reward`` in its YAML; here the entry point is ``gsm8k_answer`` and a YAML
``tool_schema`` renames it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.agent.tool import Tool, ToolResult
from agentrl.errors import ToolError
from agentrl.rewards import gsm8k_flexible

__all__ = ["Gsm8kAnswerTool"]

RESUBMIT_PENALTY = -0.05  # verl's step reward for an answer that does not improve the score


@dataclass(slots=True)
class _Instance:
    ground_truth: str | None
    response: str = ""
    reward: float = 0.0


class Gsm8kAnswerTool(Tool):
    name = "gsm8k_answer"
    description = "A tool for calculating the reward of gsm8k. (1.0 if your answer is correct, 0.0 if your answer is incorrect)"
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"}},
        "required": ["answer"],
    }

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._instances: dict[str, _Instance] = {}

    def _score(self, instance: _Instance) -> float:
        return float(gsm8k_flexible("openai/gsm8k", instance.response, instance.ground_truth))

    async def create(self, instance_id: str, ground_truth: Any = None, **create_kwargs: Any) -> None:
        self._instances[instance_id] = _Instance(None if ground_truth is None else str(ground_truth))

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise ToolError(f"{self.name} has no instance {instance_id!r} (create was not called)")
        if instance.ground_truth is None:
            raise ToolError(f"{self.name} has no ground truth for this problem (the row needs create_kwargs.ground_truth)")
        answer = str(arguments.get("answer", ""))
        instance.response = answer if answer.startswith("#### ") else "#### " + answer
        reward = self._score(instance)
        step_reward = 0.0 if reward > instance.reward else RESUBMIT_PENALTY
        instance.reward = reward
        return ToolResult(text=f"Current parsed answer={answer!r} reward={reward!r}", reward=step_reward)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        instance = self._instances.get(instance_id)
        if instance is None or instance.ground_truth is None:
            return None
        return self._score(instance)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

"""``gsm8k``: verl's GSM8K interaction - the model is told when it is wrong and may try again.

On each assistant turn without a tool call, the last assistant message is scored strictly
(``#### <number>`` against the ground truth). Correct: "Your response is correct!", reward
1.0, the episode ends. Otherwise: "Your response is incorrect! You need to reflect on your
answer and try again.", reward 0.0, the episode goes on.
"""

from __future__ import annotations

from typing import Any

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.rewards import gsm8k_strict

__all__ = ["Gsm8kInteraction", "CORRECT", "INCORRECT"]

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(Interaction):
    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._state: dict[str, dict[str, Any]] = {}

    async def start(self, instance_id: str, ground_truth: Any = None, **kwargs: Any) -> None:
        self._state[instance_id] = {"ground_truth": ground_truth, "score": 0.0}

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionResponse:
        state = self._state[instance_id]
        answer = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), "")
        state["score"] = gsm8k_strict("openai/gsm8k", answer, state["ground_truth"])
        if state["score"] == 1.0:
            return InteractionResponse(done=True, text=CORRECT, reward=1.0)
        return InteractionResponse(done=False, text=INCORRECT, reward=0.0)

    async def calculate_score(self, instance_id: str) -> float | None:
        return self._state[instance_id]["score"]

    async def finalize(self, instance_id: str) -> None:
        self._state.pop(instance_id, None)

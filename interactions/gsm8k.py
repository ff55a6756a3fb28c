"""``gsm8k``: verl's GSM8K interaction - the model is told when it is wrong and may try again.

The row selects it with ``extra_info.interaction_kwargs = {"name": "gsm8k", "query": ...,
"ground_truth": ...}``. After each assistant turn without a tool call, the last assistant
message is scored with the GSM8K rule reward (:mod:`agentrl.rewards`):

* score 1.0 -> "Your response is correct!", turn reward 1.0, the episode ends;
* otherwise -> "Your response is incorrect! You need to reflect on your answer and try
  again.", turn reward 0.0, the episode goes on (until a limit ends it).

``calculate_score`` is the score of the last judged message (0.0 before any).

``method`` (constructor knob, default ``"strict"``): ``"strict"`` needs ``#### <number>`` in
the message, as agentrl's specification of this interaction says. ``"flexible"`` reproduces
verl's code (``verl/interactions/gsm8k_interaction.py``), which prefixes "#### " to a message
that does not start with it and then scores it with the flexible method, i.e. the last number
in the message counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.errors import ConfigError, DataError
from agentrl.rewards import gsm8k_flexible, gsm8k_strict

__all__ = ["Gsm8kInteraction", "CORRECT", "INCORRECT"]

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


@dataclass(slots=True)
class _Instance:
    ground_truth: str
    score: float = 0.0


class Gsm8kInteraction(Interaction):
    def __init__(self, *, method: Literal["strict", "flexible"] = "strict", **config: Any) -> None:
        if method not in ("strict", "flexible"):
            raise ConfigError([("agent.interaction_config.gsm8k.method", f"must be 'strict' or 'flexible', got {method!r}")])
        super().__init__(method=method, **config)
        self.method = method
        self._instances: dict[str, _Instance] = {}

    async def start(self, instance_id: str, ground_truth: Any = None, **interaction_kwargs: Any) -> None:
        if ground_truth is None:
            raise DataError("the gsm8k interaction needs a ground truth", field="extra_info.interaction_kwargs.ground_truth")
        self._instances[instance_id] = _Instance(str(ground_truth))

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionResponse:
        instance = self._instances[instance_id]
        instance.score = self._score(_last_assistant_text(messages), instance.ground_truth)
        if instance.score == 1.0:
            return InteractionResponse(done=True, text=CORRECT, reward=1.0)
        return InteractionResponse(done=False, text=INCORRECT, reward=0.0)

    def _score(self, text: str, ground_truth: str) -> float:
        if self.method == "strict":
            return gsm8k_strict("openai/gsm8k", text, ground_truth)
        return gsm8k_flexible("openai/gsm8k", text if text.startswith("#### ") else "#### " + text, ground_truth)

    async def calculate_score(self, instance_id: str) -> float | None:
        return self._instances[instance_id].score

    async def finalize(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)


def _last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""

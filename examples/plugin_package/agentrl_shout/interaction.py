"""The ``loudness`` interaction: asks for a louder answer until the answer is in capitals."""

from __future__ import annotations

from typing import Any

from agentrl import Interaction, InteractionResponse

LOUDER = "Louder, please."


def is_loud(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and all(c.isupper() for c in letters)


class LoudnessInteraction(Interaction):
    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.last_loud: dict[str, bool] = {}

    async def start(self, instance_id: str, **interaction_kwargs: Any) -> None:
        self.last_loud[instance_id] = False

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionResponse:
        answer = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
        loud = self.last_loud[instance_id] = is_loud(answer)
        # reward: the turn reward of the answer judged; metrics: averaged as interaction/<key>
        return InteractionResponse(done=loud, text="" if loud else LOUDER, reward=1.0 if loud else 0.0,
                                   metrics={"loud": float(loud)})

    async def calculate_score(self, instance_id: str) -> float | None:
        return 1.0 if self.last_loud.get(instance_id) else 0.0

    async def finalize(self, instance_id: str) -> None:
        self.last_loud.pop(instance_id, None)

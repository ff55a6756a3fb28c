"""The interaction plugin API (entry point group ``agentrl.interactions``).

An interaction plays the user: after each assistant turn without a tool call it may answer
(e.g. "Your response is incorrect! ..."), give the turn a reward, and end the episode. A row
selects its interaction by ``extra_info.interaction_kwargs.name``; the other keys of
``interaction_kwargs`` are passed to ``start``.

Lifecycle per trajectory: ``start`` once, ``generate_response`` per assistant turn,
``calculate_score`` at the end, ``finalize`` ALWAYS (errors and cancellation included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Interaction", "InteractionResponse"]


@dataclass(slots=True)
class InteractionResponse:
    done: bool  # end the episode after this response
    text: str  # the user turn shown to the model (ignored when done and empty)
    reward: float = 0.0  # turn reward judging the assistant turn just finished
    metrics: dict[str, float] = field(default_factory=dict)


class Interaction:
    """Base class for interactions."""

    def __init__(self, **config: Any) -> None:
        self.config = config

    async def start(self, instance_id: str, **interaction_kwargs: Any) -> None:
        """Begin per-trajectory state from the row's ``interaction_kwargs``."""

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionResponse:
        raise NotImplementedError

    async def calculate_score(self, instance_id: str) -> float | None:
        """A final score for the episode, or None to leave the trajectory reward alone."""
        return None

    async def finalize(self, instance_id: str) -> None:
        """Free per-trajectory state. Called exactly once per ``start``, whatever happened."""

"""The ``loud`` reward: 1 for an answer in capitals, else 0."""

from __future__ import annotations

from typing import Any

from agentrl_shout.interaction import is_loud


def loud(data_source: str, solution: str, ground_truth: Any, extra_info: dict[str, Any] | None = None) -> float:
    return 1.0 if is_loud(solution) else 0.0

"""What an agent program gets and returns (entry point group ``agentrl.agents``).

An agent program is a plain function, sync or async, written against any OpenAI-compatible
client; agentrl does not appear in it beyond these two types (and a program may ignore them:
it can read ``task.base_url`` and return a plain string)::

    def solve(task: AgentTask) -> AgentResult | str:
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        ...

The ``openai_agent`` loop (``agent_loops/openai_agent.py``) calls it once per trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.data.row import Row

__all__ = ["AgentTask", "AgentResult"]


@dataclass(frozen=True, slots=True)
class AgentTask:
    """One trajectory's task: the row, and the endpoint session its model calls go to."""

    row: Row
    base_url: str  # an OpenAI-compatible base URL, this trajectory's own
    api_key: str
    model: str  # any model name is accepted; this is the one /v1/models lists

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The row's prompt as chat messages (a fresh list)."""
        return self.row.messages()


@dataclass(slots=True)
class AgentResult:
    """What a program returns: the final answer the reward function judges, or its own reward."""

    final_answer: str
    reward: float | None = None  # set: used as the trajectory reward instead of the reward function
    # (with agent.roles: a mapping role -> reward gives each role its own, docs/roles.md)
    metrics: dict[str, float] = field(default_factory=dict)  # added to the trajectory's metrics as program/<name>

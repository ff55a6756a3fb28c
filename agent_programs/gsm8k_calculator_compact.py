"""The GSM8K calculator agent of ``gsm8k_calculator``, keeping its context short as many agents do:
after each calculator result it rewrites its history to the task and one note of what it has
computed so far, instead of replaying every call and result.

Written with the plain ``openai`` client and no knowledge of agentrl. Each rewrite makes the next
call's prompt something other than an extension of the last one, so agentrl's endpoint starts a
new segment there (``Trajectory.earlier_segments``), trained with the trajectory's advantage.
"""

from __future__ import annotations

import json
from typing import Any

import openai  # at import: a missing package is refused before any work (the openai extra)

from agentrl_agent_programs.gsm8k_calculator import CALCULATOR, calculate


def solve(task: Any, max_turns: int = 4) -> str:
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    start: list[dict[str, Any]] = list(task.messages)
    messages = list(start)
    notes: list[str] = []
    answer = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message
        answer = reply.content or ""
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            expression = str(json.loads(call.function.arguments or "{}").get("expression", ""))
            notes.append(f"{expression} = {calculate(expression)}")
        # the compacted history: the task, then what is known so far, as one user note
        messages = start + [{"role": "user", "content": "Computed so far: " + "; ".join(notes) + ". Give the answer."}]
    return answer

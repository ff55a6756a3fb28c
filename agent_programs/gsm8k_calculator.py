"""A GSM8K agent with a calculator, written with the plain ``openai`` client.

It knows nothing of agentrl: it gets a base URL and a key, loops over chat completions, runs
the calculator calls itself and returns its last answer (the reward function finds ``#### N``).
"""

from __future__ import annotations

import json
from typing import Any

import openai  # at import, not at the first call: a missing package is refused before any work (the openai extra)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression to evaluate, for example 4821 * 37"}},
            "required": ["expression"],
        },
    },
}


def calculate(expression: str) -> str:
    if not expression or set(expression) - set("0123456789+-*/%(). "):
        return "error: only numbers, + - * / // % ** and parentheses"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # the character check above keeps it arithmetic
    except Exception as exc:
        return f"error: {type(exc).__name__}"


def solve(task: Any, max_turns: int = 4) -> str:
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(task.messages)
    answer = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        answer = reply.content or ""
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(args.get("expression", "")))})
    return answer

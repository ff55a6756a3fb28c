"""Rows and a script shared by the replay tests (imported by name: conftest modules collide)."""

from __future__ import annotations

from typing import Any

from agentrl.data.row import Row

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def make_row(question: str = "What is 12 * 34?", answer: str = "408", *, agent: str = "tool_agent",
             data_source: str = "agentrl/arith", index: int = 0, **extra: Any) -> Row:
    extra_info = {"index": index, "tools_kwargs": {"calculator": {"create_kwargs": {}}}, **extra}
    return Row.model_validate({
        "data_source": data_source,
        "prompt": [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": extra_info,
        "agent_name": agent,
    })


def call(expr: str) -> str:
    return CALL.format(expr=expr)


SCRIPT = {
    "r0": [call("12 * 34"), "#### 408"],
    "r1": [call("7 + 5"), "#### 13", "#### 12"],
    "r2": ["Thought: use it\nAction: calculator\nAction Input: 2 * 3\n", "Final Answer: #### 6\n"],
}

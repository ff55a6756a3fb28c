"""Row builders shared by the agent-layer tests."""

from __future__ import annotations

from typing import Any

from agentrl.data.row import Row

CALL_12x34 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


def make_row(question: str = "What is 12 * 34?", answer: str = "408", *, agent: str = "tool_agent", **extra: Any) -> Row:
    extra_info = {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {}}}}
    extra_info.update(extra)
    return Row.model_validate(
        {
            "data_source": "agentrl/arith",
            "prompt": [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": extra_info,
            "agent_name": agent,
        }
    )


def loop_with(program: Any) -> Any:
    """An ``openai_agent`` loop running ``program`` (the tests' agent program) for every row."""
    from agentrl_agent_loops.openai_agent import OpenAIAgentLoop

    return type("TestLoop", (OpenAIAgentLoop,), {"program": staticmethod(program)})()


def run_rows(loop: Any, ctx: Any, rows: list[tuple[str, Row]]) -> list[Any]:
    """Run ``loop`` on every ``(row_id, row)`` at once, each in a group of its own."""
    import asyncio

    async def go() -> list[Any]:
        return await asyncio.gather(*(loop.run(row, ctx, row_id=rid, group_id=f"g:{rid}") for rid, row in rows))

    return asyncio.run(go())

"""The GSM8K calculator agent written with a real agent framework: the OpenAI Agents SDK.

Nothing here knows agentrl: an ``Agent`` with one function tool, run by the SDK's ``Runner``
against the chat-completions endpoint it is given, its client closed before it returns. Needs the
OpenAI Agents SDK (``pip install "agentrl[agents]"``), imported with the module: without it the
entry point fails to load, and ``agentrl data validate``, ``plugins list --check``, ``train`` and
``rollout`` name the missing package before any work.

``solve_strict`` is the same agent with an output type the SDK validates, with no retries: a
final answer that does not end with ``#### <number>`` makes the SDK raise ``ModelBehaviorError``
and the run give up, as strict frameworks do. agentrl scores such an episode (finish reason
``program_error``, reward ``agent.program_error_reward``) and trains on it.
"""

from __future__ import annotations

import json
import re
from typing import Any

# the SDK first: where neither is installed, the missing module named is the SDK's, whose extra brings both
from agents import Agent, AgentOutputSchemaBase, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
import openai  # noqa: I001

from agentrl_agent_programs.gsm8k_calculator import CALCULATOR, calculate

INSTRUCTIONS = "Use the calculator tool for arithmetic. End your answer with #### <number>."
FINAL = re.compile(r"####\s*-?[\d,.]+\s*$")


async def solve(task: Any, max_turns: int = 4) -> str:
    return await _run(task, max_turns, strict=False)


async def solve_strict(task: Any, max_turns: int = 4) -> str:
    return await _run(task, max_turns, strict=True)


async def _run(task: Any, max_turns: int, *, strict: bool) -> str:
    set_tracing_disabled(True)  # no trace upload from a rollout

    async def run_calculator(context: Any, arguments: str) -> str:
        return calculate(str(json.loads(arguments or "{}").get("expression", "")))

    # the tool as the model was taught it (CALCULATOR's schema), not as the SDK would derive it
    # from a Python signature: a small model follows the tool description it was trained on
    calculator = FunctionTool(name="calculator", description=CALCULATOR["function"]["description"],
                              params_json_schema=CALCULATOR["function"]["parameters"], on_invoke_tool=run_calculator,
                              strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    try:
        agent = Agent(name="gsm8k", instructions=INSTRUCTIONS, tools=[calculator],
                      model=OpenAIChatCompletionsModel(model=task.model, openai_client=client),
                      **({"output_type": _final_answer_schema()} if strict else {}))
        result = await Runner.run(agent, task.messages[-1]["content"], max_turns=max_turns)
        return str(result.final_output or "")
    except MaxTurnsExceeded:
        if strict:
            raise  # the strict agent gives up here too
        return ""  # no final answer within its turns: scored as a wrong one
    finally:
        await client.close()  # in this event loop, not at garbage collection after it closed


def _final_answer_schema() -> Any:
    """An SDK output type whose validation accepts only an answer ending with ``#### <number>``."""

    class FinalAnswer(AgentOutputSchemaBase):
        def is_plain_text(self) -> bool:
            return False  # validated, as any structured output type is

        def name(self) -> str:
            return "final_answer"

        def json_schema(self) -> dict[str, Any]:
            return {"type": "string", "pattern": FINAL.pattern}

        def is_strict_json_schema(self) -> bool:
            return False

        def validate_json(self, json_str: str) -> str:
            if not FINAL.search(json_str.strip()):
                raise ModelBehaviorError(f"the final answer does not end with '#### <number>': {json_str[-80:]!r}")
            return json_str

    return FinalAnswer()

"""An engine failure and an aborted request end a trajectory the same way whichever sampled it:
an agent loop's ``Episode.generate`` or the OpenAI endpoint's session (``agentrl.agent.loop.
sample_turn`` is the one place for both). Both paths here take one tool-call turn (weight
version 3), then the second call fails or is aborted (the weights moved to version 4)."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from agent_helpers import CALL_12x34, loop_with, make_row
from agent_helpers import run_rows as run

from agentrl.agent.loop import AgentLoop
from agentrl.agent.scripted import ScriptedEngine
from agentrl.engines.base import FinishReason
from agentrl.errors import EngineError
from agentrl.plugins import PluginRegistry
from agentrl_agent_programs.gsm8k_calculator import CALCULATOR


class SecondCallEnds(ScriptedEngine):
    """Answers the first call of each trajectory with a tool call; the second raises (``error``)
    or comes back aborted after two tokens (``abort``)."""

    def __init__(self, tokenizer, how: str):
        super().__init__(tokenizer, {"r0": [CALL_12x34, "#### 408"]})
        self.how = how
        self.weight_version = 3

    async def generate(self, request):
        if self.calls[request.session_id or ""] == 1:
            self.weight_version = 4
            if self.how == "error":
                raise EngineError("the server went away")
            result = await super().generate(request)
            return dataclasses.replace(result, output_ids=result.output_ids[:2], logprobs=result.logprobs[:2],
                                       finish_reason=FinishReason.ABORT)
        return await super().generate(request)


def program(task):
    """Call, run the calculator, call again (the call that fails)."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = list(task.messages)
    first = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR])
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "408"}]
    return client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message.content


@pytest.mark.parametrize("how, finish, status", [("error", "engine_error", 502), ("abort", "abort", 503)])
def test_an_engine_error_or_abort_ends_a_loop_and_an_endpoint_session_alike(tiny_tokenizer, make_ctx, how, finish, status):
    tok = tiny_tokenizer
    loop: AgentLoop = PluginRegistry().load("agent_loops", "tool_agent")()
    ctx = make_ctx(SecondCallEnds(tok, how))
    (own,) = run(loop, ctx, [("r0", make_row())])
    endpoint_ctx = make_ctx(SecondCallEnds(tok, how))
    (served,) = run(loop_with(program), endpoint_ctx, [("r0", make_row(agent="openai_agent"))])

    eos = ctx.renderer.eos_id
    call_ids = tok.encode(CALL_12x34, add_special_tokens=False) + [eos]
    for t in (own, served):
        assert t.finish_reason == finish
        # the first turn and the tool's answer; nothing of the failed or aborted call
        assert t.response_ids[: len(call_ids)] == call_ids
        assert sum(t.response_mask) == len(call_ids) and [x.role for x in t.turns] == ["assistant", "tool"]
        assert (t.metrics["turns"], t.metrics["sampled_tokens"]) == (1.0, float(len(call_ids)))
        assert (t.metrics["weight_version_min"], t.metrics["weight_version_max"]) == (3.0, 3.0)
        assert t.metrics["generate_calls"] >= 1
    if how == "error":
        assert own.reward_info["error"] == "the server went away"
        assert served.reward_info["error"] == "the server went away"
    else:
        assert "error" not in own.reward_info
        assert f"Error code: {status}" in served.reward_info["error"]
    # the loop counts its attempted calls and engine failures; the endpoint the calls it answered
    assert own.metrics["generate_calls"] == 2.0 and served.metrics["generate_calls"] == 1.0
    assert own.metrics.get("engine_errors") == (1.0 if how == "error" else None)
    assert "engine_errors" not in served.metrics


class EndOfTurnAtTheLimit(ScriptedEngine):
    """Reports ``length`` for a turn whose end-of-turn id was the last token allowed, as SGLang and
    the built-in engine do (they check the length before the stop tokens)."""

    async def generate(self, request):
        result = await super().generate(request)
        return dataclasses.replace(result, finish_reason=FinishReason.LENGTH, matched_stop=None)


def test_a_turn_whose_end_of_turn_token_is_the_last_allowed_one_ends_as_a_stop(tiny_tokenizer, make_ctx):
    engine = EndOfTurnAtTheLimit(tiny_tokenizer, {"r0": [CALL_12x34, "#### 408"]})
    ctx = make_ctx(engine)
    (t,) = run(PluginRegistry().load("agent_loops", "tool_agent")(), ctx, [("r0", make_row())])
    assert t.finish_reason == "stop" and t.reward == 1.0  # not ended as length after the call
    assert [c.result for c in t.tool_calls] == ["408"]
    first = t.response_ids[t.turns[0].start : t.turns[0].end]
    tool = t.response_ids[t.turns[1].start : t.turns[1].end]
    assert first[-1] == ctx.renderer.eos_id and "<|im_end|>" not in t.messages[2]["content"]
    assert tool == ctx.renderer.observation_ids([{"role": "tool", "content": "408"}])  # the template's separator first
    assert t.response_ids[t.turns[-1].end :] == ctx.renderer.separator_ids

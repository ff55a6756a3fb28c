"""Property tests: arbitrary model output never breaks the parsers, the loops or the token stream."""

from __future__ import annotations

import asyncio

from agent_helpers import make_row
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool_parsers import HermesToolParser, ReactToolParser

FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "\n", "{", "}", '"name"', ": ", '"calculator"', '"arguments"', '{"expression": "1+2"}',
    "Action: calculator", "Action Input: 2*3", "Final Answer: 6", "Thought: hm", "#### 7", "<|im_end|>", "x" * 50, "[", "]",
])
TEXT = st.one_of(st.text(max_size=200), st.lists(FRAGMENTS, max_size=12).map("".join))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(TEXT)
def test_parsers_never_raise_and_keep_every_call(text):
    for parser in (HermesToolParser(), ReactToolParser()):
        turn = parser.parse(text)
        for call in turn.calls:
            assert call.raw
            if call.error is None:  # a usable call has a name and a dict of arguments
                assert isinstance(call.name, str) and isinstance(call.arguments, dict)
            else:  # a malformed one says what is wrong, for the model
                assert call.error == "bad_json" and call.detail
    assert HermesToolParser().parse(text).content == HermesToolParser().parse(text).content.strip()


@FAST
@given(turns=st.lists(TEXT, min_size=1, max_size=6), loop=st.sampled_from(["tool_agent", "react"]),
       max_tokens=st.integers(16, 200), max_turns=st.integers(1, 4))
def test_any_model_output_keeps_the_trajectory_aligned_and_within_limits(make_ctx, tiny_tokenizer, turns, loop, max_tokens, max_turns):
    engine = ScriptedEngine(tiny_tokenizer, lambda row_id, index, request: turns[index % len(turns)])
    ctx = make_ctx(engine, limits={"max_response_tokens": max_tokens, "max_assistant_turns": max_turns, "max_new_tokens": 64,
                                   "trajectory_timeout_s": 10.0})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row(agent=loop))]))
    assert t.finish_reason != "loop_error", t.reward_info
    assert len(t.response_ids) == len(t.response_mask) == len(t.logprobs)
    assert len(t.response_ids) <= max_tokens
    assert t.metrics["turns"] <= max_turns
    position = 0
    for turn in t.turns:  # disjoint, ordered, each of one kind of token
        assert turn.start == position and turn.end >= turn.start
        assert set(t.response_mask[turn.start:turn.end]) <= ({1} if turn.role == "assistant" else {0})
        position = turn.end
    assert not any(t.response_mask[position:])  # only masked template glue after the last turn
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.response_mask) if m == 0)

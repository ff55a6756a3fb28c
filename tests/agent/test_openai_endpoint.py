"""The OpenAI-compatible endpoint and the ``openai_agent`` loop, driven by the official ``openai``
client: exact token streams (merge of extending calls, a new segment when history is rewritten),
streaming, tool calls, refusals, and the real tiny model through the built-in engine."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agent_helpers import loop_with, make_row
from agent_helpers import run_rows as run

from agentrl.agent.scripted import ScriptedEngine
from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


def row():
    return make_row(agent="openai_agent")


def test_sync_client_tool_call_is_merged_token_by_token(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "#### 408"]})
    ctx = make_ctx(engine)
    seen = {}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = task.messages
        first = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR])
        seen["first"] = first
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        second = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR])
        seen["messages"] = messages + [{"role": "assistant", "content": second.choices[0].message.content}]
        return second.choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    r = ctx.renderer
    first = seen["first"]
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 34"}
    prompt = r.prompt_ids(row().messages(), [CALCULATOR])
    sampled1 = tiny_tokenizer.encode(CALL, add_special_tokens=False) + [r.eos_id]
    sampled2 = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    observed = r.observation_ids([{"role": "tool", "tool_call_id": call.id, "content": "408"}])
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == len(sampled1)
    assert t.prompt_ids == prompt
    assert t.response_ids == sampled1 + observed + sampled2 + r.separator_ids
    assert t.response_mask == [1] * len(sampled1) + [0] * len(observed) + [1] * len(sampled2) + [0] * len(r.separator_ids)
    assert t.logprobs == [-0.5] * len(sampled1) + [0.0] * len(observed) + [-0.5] * len(sampled2) + [0.0] * len(r.separator_ids)
    # the merged stream is what the chat template renders for the whole conversation
    full = [dict(m, tool_calls=[{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}])
            if m.get("tool_calls") else m for m in seen["messages"]]
    assert t.prompt_ids + t.response_ids == r.render_ids(full, [CALCULATOR])
    assert [turn.role for turn in t.turns] == ["assistant", "tool", "assistant"]
    assert t.finish_reason == "stop" and t.reward == 1.0
    assert t.metrics["segment_splits"] == 0 and t.metrics["generate_calls"] == 2
    assert engine.requests[1].input_ids == prompt + sampled1 + observed  # the sampled ids went back unchanged


def test_async_streaming_client_and_a_rewritten_history_starts_a_segment(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["first answer", "#### 408"]})
    ctx = make_ctx(engine)
    chunks = []

    async def program(task):
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        stream = await client.chat.completions.create(model=task.model, messages=task.messages, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            chunks.append(chunk)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # the program summarises instead of echoing its history: a new segment
        rewritten = [{"role": "user", "content": f"Earlier you said: {text}. Answer now."}]
        answer = await client.chat.completions.create(model=task.model, messages=rewritten)
        return answer.choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    r = ctx.renderer
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "first answer"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(tiny_tokenizer.encode("first answer", add_special_tokens=False)) + 1
    sampled = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    assert t.prompt_ids == r.prompt_ids([{"role": "user", "content": "Earlier you said: first answer. Answer now."}])
    assert t.response_ids == sampled + r.separator_ids
    assert t.response_mask == [1] * len(sampled) + [0] * len(r.separator_ids)
    assert t.metrics["segment_splits"] == 1
    # the first segment, exact as sampled under its own prompt: the trainer trains it too
    first = tiny_tokenizer.encode("first answer", add_special_tokens=False) + [r.eos_id]
    (seg,) = t.earlier_segments
    assert seg.prompt_ids == r.prompt_ids(row().messages())
    assert seg.response_ids == first and seg.response_mask == [1] * len(first)
    assert seg.logprobs == [-0.5] * len(first)  # the scripted engine's logprob
    assert [(x.role, x.start, x.end) for x in seg.turns] == [("assistant", 0, len(first))]
    assert t.metrics["segment_earlier_tokens"] == len(first)
    assert t.reward == 1.0


def test_refusals_name_the_field(tiny_tokenizer, make_ctx):
    import httpx

    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["#### 408"]})
    ctx = make_ctx(engine)
    errors = {}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        for field, extra in [("n", {"n": 2}), ("tool_choice", {"tool_choice": "required"}), ("stop", {"stop": [3]}),
                           ("top_logprobs", {"logprobs": True, "top_logprobs": 2})]:
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=task.model, messages=task.messages, **extra)
            errors[field] = info.value.body
        for field, body in [("messages", {"messages": []}), ("tools", {"messages": task.messages, "tools": "calculator"})]:
            with pytest.raises(openai.BadRequestError) as info:  # the chat route and /tokenize read them alike
                client.chat.completions.create(model=task.model, messages=body["messages"], extra_body=body)
            errors[field] = info.value.body
            tokenize = httpx.post(task.base_url + "/tokenize", json=body, headers={"Authorization": f"Bearer {task.api_key}"})
            errors[f"tokenize {field}"] = tokenize.json()["error"] | {"status": tokenize.status_code}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=task.base_url, api_key="wrong", max_retries=0).models.list()
        other = task.base_url.rsplit("/s/", 1)[0] + "/s/nosuchsession/v1"
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=other, api_key=task.api_key, max_retries=0).models.list()
        assert [m.id for m in client.models.list()] == [task.model]
        return client.chat.completions.create(model=task.model, messages=task.messages).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "stop", t.reward_info
    assert errors["n"]["param"] == "n" and "only n=1" in errors["n"]["message"]
    assert errors["tool_choice"]["param"] == "tool_choice"
    assert errors["stop"]["param"] == "stop" and "a string or a list of strings" in errors["stop"]["message"]
    assert errors["top_logprobs"]["param"] == "top_logprobs" and "only the sampled tokens'" in errors["top_logprobs"]["message"]
    assert errors["messages"]["param"] == "messages" and errors["messages"]["message"] == "messages: a non-empty list is required"
    assert errors["tokenize messages"]["message"] == "messages (or prompt): a non-empty list of messages is required"
    assert errors["tools"]["param"] == "tools" and errors["tools"]["message"] == "tools: a list of tool objects is required"
    assert {k: errors[f"tokenize {k}"]["param"] for k in ("messages", "tools")} == {"messages": "messages", "tools": "tools"}
    assert errors["tokenize messages"]["status"] == errors["tokenize tools"]["status"] == 400
    # refused requests did not end the trajectory, and the program went on: its episode is scored
    assert t.reward == 1.0


def test_turn_limit_ends_the_trajectory_with_its_finish_reason(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, CALL, CALL]})
    ctx = make_ctx(engine, limits={"max_assistant_turns": 2})

    def program(task):
        from agentrl_agent_programs.gsm8k_calculator import solve

        return solve(task, max_turns=5)

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "max_assistant_turns"
    assert t.metrics["turns"] == 2 and [turn.role for turn in t.turns] == ["assistant", "tool", "assistant"]


def test_concurrent_agents_on_the_real_tiny_model_keep_their_own_sessions(tiny_model_dir, make_ctx):
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engines.builtin import BuiltinEngine
    from agentrl_agent_programs.gsm8k_calculator import solve

    engine = BuiltinEngine(tiny_model_dir, max_batch_size=8, seed=0)
    try:
        ctx = make_ctx(engine, limits={"max_new_tokens": 12, "max_response_tokens": 64, "max_assistant_turns": 3})
        rows = [(f"r{i}", make_row(f"What is {i} + 1?", str(i + 1), agent="openai_agent")) for i in range(4)]
        trajectories = run(loop_with(solve), ctx, rows)
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for (rid, r), t in zip(rows, trajectories):
        assert t.row_id == rid and t.finish_reason in {"stop", "length", "max_assistant_turns", "response_budget"}, t.reward_info
        assert t.prompt_ids == ctx.renderer.prompt_ids(r.messages(), [CALCULATOR])  # its own row, no mixing
        assert sum(t.response_mask) > 0
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
        reference = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(t.prompt_ids):, None])[:, 0]
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        assert (torch.tensor(t.logprobs)[mask] - reference[mask]).abs().max() < 1e-4


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_agent_trains_token_exact(streamed, tiny_tokenizer, make_ctx):
    """A real framework (the OpenAI Agents SDK) that knows nothing of agentrl: its tool round trip
    is merged into one exact stream, whether it runs on whole answers or streams them
    (``Runner.run_streamed`` over the endpoint's server-sent events, tool-call deltas included)."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "#### 408"]})
    ctx = make_ctx(engine)
    executed, events = [], []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        executed.append(expression)
        return str(eval(expression, {"__builtins__": {}}, {}))

    async def program(task):
        client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        agent = Agent(name="math", instructions="Use the calculator.", tools=[calculator],
                      model=OpenAIChatCompletionsModel(model=task.model, openai_client=client))
        if streamed:
            result = Runner.run_streamed(agent, "What is 12 * 34?", max_turns=4)
            async for event in result.stream_events():
                events.append(event.type)
        else:
            result = await Runner.run(agent, "What is 12 * 34?", max_turns=4)
        await client.close()
        return result.final_output

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "stop", t.reward_info
    assert executed == ["12 * 34"] and t.reward == 1.0
    assert ("raw_response_event" in events) == streamed
    r = ctx.renderer
    first, second = engine.requests
    sampled1 = tiny_tokenizer.encode(CALL, add_special_tokens=False) + [r.eos_id]
    sampled2 = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    assert t.prompt_ids == first.input_ids and second.input_ids[: len(first.input_ids) + len(sampled1)] == first.input_ids + sampled1
    observed = second.input_ids[len(first.input_ids) + len(sampled1):]
    assert tiny_tokenizer.decode(observed).count("408") == 1  # the tool result, masked
    assert t.response_ids == sampled1 + observed + sampled2 + r.separator_ids
    assert t.response_mask == [1] * len(sampled1) + [0] * len(observed) + [1] * len(sampled2) + [0] * len(r.separator_ids)
    assert t.metrics["segment_splits"] == 0


def test_a_program_past_the_trajectory_timeout_ends_it_and_its_session(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["#### 408"]})
    ctx = make_ctx(engine, limits={"trajectory_timeout_s": 0.5})
    urls = []

    async def program(task):
        urls.append(task.base_url)
        await asyncio.sleep(30)

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "trajectory_timeout" and t.response_ids == []
    from agentrl.agent.openai_endpoint import endpoint

    with pytest.raises(openai.NotFoundError):  # the session is closed with its trajectory
        openai.OpenAI(base_url=urls[0], api_key=endpoint().api_key, max_retries=0).models.list()


def test_the_program_is_found_by_entry_point(tiny_tokenizer):
    from agentrl.errors import PluginError
    from agentrl.plugins import PluginRegistry
    from agentrl_agent_loops.openai_agent import find_program
    from agentrl_agent_programs.gsm8k_calculator import solve

    from agentrl_agent_programs.gsm8k_calculator_compact import solve as compact

    assert find_program(make_row(agent="openai_agent", agent_program="gsm8k_calculator"), PluginRegistry()) is solve
    assert find_program(make_row(agent="openai_agent", agent_program="gsm8k_calculator_compact"), PluginRegistry()) is compact
    with pytest.raises(PluginError, match="no plugin named 'nosuch' in group agentrl.agents"):
        find_program(make_row(agent="openai_agent", agent_program="nosuch"), PluginRegistry())
    # several installed and the row names none: refused with the names
    with pytest.raises(PluginError, match=r"3 agent programs are installed \(gsm8k_calculator, gsm8k_calculator_agents_sdk, gsm8k_calculator_compact\); name one"):
        find_program(make_row(agent="openai_agent"), PluginRegistry())


def test_the_response_budget_caps_max_tokens_and_ends_the_trajectory(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "#### 408"]})
    call_len = len(tiny_tokenizer.encode(CALL, add_special_tokens=False)) + 1
    ctx = make_ctx(engine, limits={"max_response_tokens": call_len + 3, "max_new_tokens": 500})

    def program(task):
        from agentrl_agent_programs.gsm8k_calculator import solve

        return solve(task)

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert [r.sampling.max_new_tokens for r in engine.requests] == [call_len + 3]  # the budget, not max_new_tokens
    assert t.finish_reason == "response_budget" and [turn.role for turn in t.turns] == ["assistant"]


def test_streamed_tool_calls_assemble_in_the_client_and_merge_token_by_token(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [CALL, "#### 408"]})
    ctx = make_ctx(engine)
    seen = {}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR], stream=True):
            for piece in chunk.choices[0].delta.tool_calls or []:  # assembled as clients do, by index
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        seen["calls"], seen["finish"] = calls, finish
        (call,) = calls.values()
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "408"}]
        answer = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    (call,) = seen["calls"].values()
    assert seen["finish"] == "tool_calls" and call["name"] == "calculator" and call["id"]
    assert t.metrics["tool_calls"] == 1.0  # the call the policy wrote, for tool_use_rate
    assert json.loads(call["arguments"]) == {"expression": "12 * 34"}
    # the streamed call, sent back as the client assembled it, extends the context exactly
    r = ctx.renderer
    sampled1 = tiny_tokenizer.encode(CALL, add_special_tokens=False) + [r.eos_id]
    sampled2 = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    first, second = engine.requests
    assert second.input_ids[: len(first.input_ids) + len(sampled1)] == first.input_ids + sampled1
    assert t.metrics["segment_splits"] == 0 and t.reward == 1.0
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant"]
    assert t.response_ids[: len(sampled1)] == sampled1 and t.response_ids[t.turns[2].start : t.turns[2].end] == sampled2


def test_the_strict_flag_of_a_tool_is_not_rendered(tiny_tokenizer, make_ctx):
    """OpenAI's ``strict`` asks for constrained decoding (not done here) and describes nothing:
    frameworks send it by default, and the model sees its tools as without it."""
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["#### 1"], "r1": ["#### 1"]})
    ctx = make_ctx(engine)
    strict = {**CALCULATOR, "function": {**CALCULATOR["function"], "strict": True}}

    def program_with(tool):
        def program(task):
            client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
            return client.chat.completions.create(model=task.model, messages=task.messages, tools=[tool]).choices[0].message.content

        return program

    run(loop_with(program_with(strict)), ctx, [("r0", row())])
    run(loop_with(program_with(CALCULATOR)), ctx, [("r1", row())])
    assert engine.requests[0].input_ids == engine.requests[1].input_ids == ctx.renderer.prompt_ids(row().messages(), [CALCULATOR])
    assert "strict" not in tiny_tokenizer.decode(engine.requests[0].input_ids)



def test_vllm_token_fields_tokenize_and_the_tokens_route_for_clients_that_keep_ids(tiny_tokenizer, make_ctx):
    """What verifiers' token client (prime-rl's) asks of vLLM: the sampled tokens' logprobs and
    ids, /tokenize, and generation from prompt ids it stitched: ids that extend the trajectory
    are merged (the rest masked as sent); others start a segment; a bad id is refused by name."""
    import httpx

    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["first", "second", "third"]})
    ctx = make_ctx(engine)
    r = ctx.renderer
    seen = {}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        first = client.chat.completions.create(model=task.model, messages=task.messages, logprobs=True,
                                               extra_body={"return_token_ids": True})
        seen["first"] = first
        http = httpx.Client(headers={"Authorization": f"Bearer {task.api_key}"})
        messages = task.messages + [{"role": "assistant", "content": "first"}, {"role": "user", "content": "again"}]
        seen["tokenize"] = http.post(task.base_url.removesuffix("/v1") + "/tokenize", json={"messages": messages}).json()
        seen["tokenize_base"] = http.post(task.base_url + "/tokenize", json={
            "messages": messages[:-1], "add_generation_prompt": False}).json()
        seen["bad"] = http.post(task.base_url + "/chat/completions/tokens", json={"messages": messages, "tokens": [-1]})
        extra = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        seen["delta"] = r.observation_ids([{"role": "user", "content": "again"}])
        second = http.post(task.base_url + "/chat/completions/tokens", json={
            "messages": messages, "tokens": extra + seen["delta"], "return_token_ids": True}).json()
        seen["second"] = second
        rewritten = r.prompt_ids([{"role": "user", "content": "Start over."}])
        http.post(task.base_url + "/chat/completions/tokens", json={"messages": [{"role": "user", "content": "Start over."}],
                                                                     "tokens": rewritten})
        return "third"

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    first = seen["first"]
    sampled1 = tiny_tokenizer.encode("first", add_special_tokens=False) + [r.eos_id]
    assert first.model_extra["prompt_token_ids"] == r.prompt_ids(row().messages())
    assert first.choices[0].model_extra["token_ids"] == sampled1
    assert [c.logprob for c in first.choices[0].logprobs.content] == [-0.5] * len(sampled1)
    assert "".join(c.token for c in first.choices[0].logprobs.content) == tiny_tokenizer.decode(sampled1)
    whole = row().messages() + [{"role": "assistant", "content": "first"}, {"role": "user", "content": "again"}]
    assert seen["tokenize"]["tokens"] == r.prompt_ids(whole) and seen["tokenize"]["count"] == len(r.prompt_ids(whole))
    assert seen["tokenize_base"]["tokens"] == r.render_ids(whole[:-1])
    assert seen["bad"].status_code == 400 and seen["bad"].json()["error"]["param"] == "tokens"
    # the stitched ids extended the first segment: the observation exactly as sent, masked
    sampled2 = tiny_tokenizer.encode("second", add_special_tokens=False) + [r.eos_id]
    assert engine.requests[1].input_ids == r.prompt_ids(row().messages()) + sampled1 + seen["delta"]
    assert seen["second"]["choices"][0]["token_ids"] == sampled2
    (seg,) = t.earlier_segments
    assert seg.response_ids == sampled1 + seen["delta"] + sampled2
    assert seg.response_mask == [1] * len(sampled1) + [0] * len(seen["delta"]) + [1] * len(sampled2)
    # ids that do not extend it start a segment of their own, from exactly those ids
    assert t.prompt_ids == r.prompt_ids([{"role": "user", "content": "Start over."}]) and t.metrics["segment_splits"] == 1

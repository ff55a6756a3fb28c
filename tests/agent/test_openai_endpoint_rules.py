"""What the OpenAI-compatible endpoint does with what agents written for OpenAI's API meet: a
malformed tool call comes back as the model's text (as vLLM and SGLang answer it), a program
that gives up on the model's output is a scored episode while a failure of the infrastructure
is not, stop strings of any length end generation token-exactly, and sampling fields the
trainer owns are overridden (said once) while unknown fields are ignored. All through the
official ``openai`` client over real HTTP, on the scripted engine."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from agent_helpers import loop_with, make_row
from agent_helpers import run_rows as run

from agentrl.agent import openai_request
from agentrl.agent.scripted import ScriptedEngine
from agentrl.errors import EngineError
from agentrl.trainer.step import INFRA_FAILURES, failure_metrics, trajectory_metrics, usable_trajectories
from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

BROKEN_JSON = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}\n</tool_call>'
UNKNOWN_TOOL = '<tool_call>\n{"name": "calculater", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
WRONG_TYPE = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 408}}\n</tool_call>'
NOT_AN_OBJECT = '<tool_call>\n{"name": "calculator", "arguments": "12 * 34"}\n</tool_call>'


def row():
    return make_row(agent="openai_agent")


def client_of(task):
    return openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)


def ask(task, streamed: bool, pieces: list | None = None, **kwargs):
    """One request; (content, tool calls, finish reason), assembled from the stream when streamed
    (the content deltas appended to ``pieces``)."""
    client = client_of(task)
    if not streamed:
        choice = client.chat.completions.create(model=task.model, messages=task.messages, **kwargs).choices[0]
        return choice.message.content, choice.message.tool_calls, choice.finish_reason
    content, calls, finish = "", [], None
    pieces = [] if pieces is None else pieces
    for chunk in client.chat.completions.create(model=task.model, messages=task.messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        pieces.append(delta.content or "")
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return content, calls or None, finish


# ------------------------------------------------------------------------------ malformed calls


@pytest.mark.parametrize("streamed", [False, True])
def test_a_malformed_call_comes_back_as_the_models_text_and_is_recorded(streamed, tiny_tokenizer, make_ctx):
    script = {"bad_json": [BROKEN_JSON], "unknown_tool": [UNKNOWN_TOOL], "invalid_arguments": [WRONG_TYPE],
              "not_an_object": [NOT_AN_OBJECT]}
    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = make_ctx(engine)
    answers, pieces = {}, {}

    def program(task):
        index = task.row.extra_info.index
        content, calls, finish = ask(task, streamed, pieces.setdefault(index, []), tools=[CALCULATOR])
        answers[index] = (content, calls, finish)
        return content

    rows = [(rid, make_row(agent="openai_agent", index=i)) for i, rid in enumerate(script)]
    trajectories = run(loop_with(program), ctx, rows)
    kinds = {"bad_json": "bad_json", "unknown_tool": "unknown_tool", "invalid_arguments": "invalid_arguments",
             "not_an_object": "bad_json"}
    for i, (rid, t) in enumerate(zip(script, trajectories)):
        content, calls, finish = answers[i]
        # the model's text, whole, as content: never an empty message, never substituted arguments
        assert (content, calls, finish) == (script[rid][0], None, "stop"), rid
        sampled = tiny_tokenizer.encode(script[rid][0], add_special_tokens=False) + [ctx.renderer.eos_id]
        assert t.response_ids[: len(sampled)] == sampled and t.finish_reason == "stop"
        (record,) = t.tool_calls  # kept with its kind and text, for the metrics and replay
        assert (record.turn, record.error, record.raw) == (0, kinds[rid], script[rid][0]), rid
        assert t.metrics[f"tool_errors/{kinds[rid]}"] == 1.0 and t.metrics["tool_calls"] == 1.0
    assert trajectories[1].tool_calls[0].name == "calculater"
    m = trajectory_metrics(trajectories)
    assert (m["tool_errors/bad_json"], m["tool_errors/unknown_tool"], m["tool_errors/invalid_arguments"]) == (2.0, 1.0, 1.0)
    # the misspelled name is counted under tool_errors/unknown_tool only, never as a key of its own;
    # the call with arguments of the wrong type named a real tool
    assert [k for k in m if k.startswith("tool/")] == ["tool/calculator/calls"] and m["tool/calculator/calls"] == 1.0
    if streamed:  # the text streams as content; no tool_calls delta was sent
        assert ["".join(pieces[i]) for i in range(4)] == [script[rid][0] for rid in script]


def test_a_well_formed_call_still_comes_back_as_tool_calls(tiny_tokenizer, make_ctx):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [call]})
    seen = {}

    def program(task):
        seen["answer"] = ask(task, False, tools=[CALCULATOR])
        return ""

    (t,) = run(loop_with(program), make_ctx(engine), [("r0", row())])
    content, calls, finish = seen["answer"]
    assert (content, finish, [c.function.name for c in calls]) == (None, "tool_calls", ["calculator"])
    assert t.tool_calls == [] and not [k for k in t.metrics if k.startswith("tool_errors/")]


@pytest.mark.parametrize("policy", ["penalize", "end"])
def test_the_malformed_call_policy_applies_to_the_endpoint(policy, tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [BROKEN_JSON, "#### 408"]})
    ctx = make_ctx(engine, limits={"malformed_call_policy": policy, "malformed_call_penalty": -0.25})
    second = {}

    def program(task):
        client = client_of(task)
        first = client.chat.completions.create(model=task.model, messages=task.messages, tools=[CALCULATOR]).choices[0].message
        messages = [*task.messages, first.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        try:
            second["content"] = client.chat.completions.create(model=task.model, messages=messages,
                                                               tools=[CALCULATOR]).choices[0].message.content
        except openai.BadRequestError as exc:
            second["refused"] = exc.body["message"]
            raise
        return second["content"]

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    if policy == "end":  # the answer was sent, then the trajectory ended: the next request is refused
        assert t.finish_reason == "malformed_tool_call" and "malformed_tool_call" in second["refused"]
        assert [x.role for x in t.turns] == ["assistant"] and t.turns[0].reward is None
    else:
        assert t.finish_reason == "stop" and second["content"] == "#### 408" and t.reward == 1.0
        assert [(x.role, x.reward) for x in t.turns] == [("assistant", -0.25), ("user", None), ("assistant", None)]


# ----------------------------------------------------------------------- program errors vs infra


def test_a_program_that_gives_up_on_the_models_output_is_a_scored_episode(tiny_tokenizer, make_ctx):
    class ModelBehaviorError(Exception):  # what a strict framework raises, by name
        pass

    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["not what the framework wanted"], "r1": ["#### 408"]})
    ctx = make_ctx(engine, agent={"program_error_reward": -0.5})

    def program(task):
        content = client_of(task).chat.completions.create(model=task.model, messages=task.messages).choices[0].message.content
        if not content.startswith("####"):
            raise ModelBehaviorError("Exceeded maximum output retries")
        return content

    failed, fine = run(loop_with(program), ctx, [("r0", row()), ("r1", row())])
    assert failed.finish_reason == "program_error" and failed.finish_reason not in INFRA_FAILURES
    assert failed.reward == -0.5 and failed.reward_info["exception_type"] == "ModelBehaviorError"
    assert failed.reward_info["error"] == "ModelBehaviorError: Exceeded maximum output retries"
    sampled = tiny_tokenizer.encode("not what the framework wanted", add_special_tokens=False) + [ctx.renderer.eos_id]
    assert failed.response_ids[: len(sampled)] == sampled and sum(failed.response_mask) == len(sampled)
    assert failed.metrics["program_errors/ModelBehaviorError"] == 1.0
    # kept in the loss, not a failure; counted per exception type
    assert usable_trajectories([failed, fine], "step 1") == [failed, fine]
    assert failure_metrics([failed, fine], max_rate=0.0) == {"failures/rate": 0.0}
    assert trajectory_metrics([failed, fine])["program_errors/ModelBehaviorError"] == 1.0
    assert fine.finish_reason == "stop" and fine.reward == 1.0


def test_an_engine_that_dies_is_still_infrastructure(tiny_tokenizer, make_ctx):
    def script(row_id, index, request):
        raise EngineError("the server went away")

    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script))

    def program(task):
        return client_of(task).chat.completions.create(model=task.model, messages=task.messages).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "engine_error" and t.finish_reason in INFRA_FAILURES
    assert "the server went away" in t.reward_info["error"] and failure_metrics([t])["failures/engine_error"] == 1.0


def test_an_endpoint_crash_and_a_transport_error_are_infrastructure(tiny_tokenizer, make_ctx):
    def script(row_id, index, request):
        raise RuntimeError("a bug in the engine")  # not an EngineError: the endpoint answers 500

    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script))

    def crashing(task):
        return client_of(task).chat.completions.create(model=task.model, messages=task.messages).choices[0].message.content

    def unreachable(task):
        client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=task.api_key, max_retries=0)  # nothing listens
        return client.chat.completions.create(model=task.model, messages=task.messages).choices[0].message.content

    (crashed,) = run(loop_with(crashing), ctx, [("r0", row())])
    (lost,) = run(loop_with(unreachable), ctx, [("r1", row())])
    assert crashed.finish_reason == "loop_error" and "the endpoint failed: RuntimeError: a bug in the engine" in crashed.reward_info["error"]
    assert lost.finish_reason == "loop_error" and lost.reward_info["error"].startswith("APIConnectionError")
    assert failure_metrics([crashed, lost])["failures/loop_error"] == 2.0


def test_a_transport_error_is_found_anywhere_in_the_chain_and_only_a_5xx_status_is_one():
    import httpx

    from agentrl.agent.openai_wire import is_transport_error

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")

    def status(code):
        return openai.APIStatusError("status", response=httpx.Response(code, request=request), body=None)

    def raised_from(cause):
        try:
            try:
                raise cause
            except BaseException as exc:
                raise ValueError("the framework gave up") from exc
        except ValueError as exc:
            return exc

    assert is_transport_error(openai.APIConnectionError(request=request)) and is_transport_error(status(502))
    assert is_transport_error(raised_from(httpx.ConnectError("refused"))) and is_transport_error(raised_from(TimeoutError()))
    assert not is_transport_error(status(400)) and not is_transport_error(raised_from(KeyError("choices")))


def test_a_refused_request_that_the_program_does_not_survive_is_infrastructure(tiny_tokenizer, make_ctx):
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, {"r0": ["#### 408"]}))

    def program(task):
        return client_of(task).chat.completions.create(model=task.model, messages=task.messages, n=3).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "loop_error" and "the endpoint refused a request: n=3" in t.reward_info["error"]


# ------------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("streamed", [False, True])
def test_a_multi_token_stop_string_ends_generation_token_exactly(streamed, tiny_tokenizer, make_ctx):
    text = "#### 408\n\n\nand more the model would write"
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [text]})
    ctx = make_ctx(engine)
    seen, pieces = {}, []

    def program(task):
        seen["answer"] = ask(task, streamed, pieces, stop=["\n\n\n"])
        return seen["answer"][0]

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert seen["answer"] == ("#### 408", None, "stop")
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)
    sampled = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + newline * 3  # up to the completing token
    assert len(newline) == 1 and engine.requests[0].sampling.stop == ("\n\n\n",)
    assert t.response_ids == sampled and t.response_mask == [1] * len(sampled) and t.logprobs == [-0.5] * len(sampled)
    assert t.finish_reason == "stop" and t.reward == 1.0
    if streamed:  # no part of the stop string was ever sent
        assert "".join(pieces) == "#### 408" and not any("\n" in piece for piece in pieces)


def test_a_stop_string_split_across_two_tokens_cuts_inside_a_token(tiny_tokenizer, make_ctx):
    # "Observation" and ":" are one token each: "vation:" ends in the second and starts inside the first
    assert [tiny_tokenizer.decode([i]) for i in tiny_tokenizer.encode("Observation:", add_special_tokens=False)] == ["Observation", ":"]
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["I think Observation: 5"], "r1": ["I think Observation: 5"]})
    ctx = make_ctx(engine)
    seen = {}

    def program(task):
        extra = {"include_stop_str_in_output": True} if task.row.extra_info.index == 1 else {}
        seen[task.row.extra_info.index] = ask(task, False, stop=["vation:", "never"], extra_body=extra)
        return ""

    kept, cut = run(loop_with(program), ctx, [("r1", make_row(agent="openai_agent", index=1)), ("r0", row())])
    assert seen[0] == ("I think Obser", None, "stop")
    assert seen[1] == ("I think Observation:", None, "stop")  # vLLM's include_stop_str_in_output
    sampled = tiny_tokenizer.encode("I think Observation:", add_special_tokens=False)
    assert cut.response_ids == sampled == kept.response_ids and cut.response_mask == [1] * len(sampled)


def test_the_cookbook_loop_after_a_stop_string_extends_one_segment(tiny_tokenizer, make_ctx):
    """The SDK's message object appended as it came, then a user turn: the context extends (the
    stop string is not in the echoed content, and the sampled ids are never re-tokenized)."""
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["Thought: add\n\n\n", "#### 408"]})
    ctx = make_ctx(engine)

    def program(task):
        client = client_of(task)
        messages = list(task.messages)
        first = client.chat.completions.create(model=task.model, messages=messages, stop=["\n\n\n"]).choices[0].message
        messages += [first, {"role": "user", "content": "Go on."}]
        return client.chat.completions.create(model=task.model, messages=messages, stop=["\n\n\n"]).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", row())])
    r = ctx.renderer
    first = tiny_tokenizer.encode("Thought: add\n\n\n", add_special_tokens=False)
    second = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    observed = r.observation_ids([{"role": "user", "content": "Go on."}], after_eos=False)
    assert t.metrics["segment_splits"] == 0 and t.reward == 1.0
    assert t.response_ids == first + observed + second + r.separator_ids
    assert t.response_mask == [1] * len(first) + [0] * len(observed) + [1] * len(second) + [0] * len(r.separator_ids)


# -------------------------------------------------------------- sampling fields and unknown fields


def test_trainer_owned_sampling_is_overridden_said_once_and_unknown_fields_are_ignored(tiny_tokenizer, make_ctx, caplog):
    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["one", "two"]})
    ctx = make_ctx(engine)
    openai_request.logged_overrides.clear()

    def program(task):
        client = client_of(task)
        for _ in range(2):
            content = client.chat.completions.create(
                model=task.model, messages=task.messages, temperature=0.2, top_p=0.5, frequency_penalty=0.3,
                max_tokens=100000, extra_body={"no_such_field": {"a": 1}, "top_k": 7, "chat_template_kwargs": {}},
            ).choices[0].message.content
        return content

    with caplog.at_level(logging.WARNING, logger="agentrl.agent.openai_endpoint"):
        (t,) = run(loop_with(program), ctx, [("r0", row())])
    assert t.finish_reason == "stop", t.reward_info
    used = ctx.sampling
    for request in engine.requests:
        s = request.sampling
        assert (s.temperature, s.top_p, s.top_k) == (used.temperature, used.top_p, used.top_k)
        assert s.max_new_tokens == ctx.limits.max_new_tokens
    lines = sorted(r.getMessage() for r in caplog.records)
    assert len(lines) == 5, lines  # one per parameter, the first time only
    assert f"asked temperature=0.2; the rollout's is used instead: temperature={used.temperature}" in " ".join(lines)
    assert "asked frequency_penalty=0.3; the rollout's is used instead: frequency_penalty=0.0 (not applied)" in " ".join(lines)
    assert f"asked max_tokens=100000; at most rollout.max_new_tokens={ctx.limits.max_new_tokens}" in " ".join(lines)
    assert not any("no_such_field" in line for line in lines)


def test_a_stop_string_on_the_real_tiny_model_through_the_endpoint(tiny_model_dir, tiny_tokenizer, make_ctx):
    """The built-in engine with the tiny model behind the endpoint: the same seeded call without a
    stop string and with one that starts inside one sampled token and ends in the next; the
    second keeps exactly the first's tokens up to the completing one, its content cut before the
    string, streamed or not."""
    from agentrl.engines.builtin import BuiltinEngine

    engine = BuiltinEngine(tiny_model_dir, max_batch_size=4, seed=0)
    seen = {}

    def program_with(stop, streamed):
        def program(task):
            seen[(stop, streamed)] = ask(task, streamed, **({"stop": [stop]} if stop else {}))
            return ""

        return program

    try:
        ctx = make_ctx(engine, limits={"max_new_tokens": 24})
        free = asyncio.run(loop_with(program_with(None, False)).run(row(), ctx, row_id="r0", group_id="g", seed=5))
        sampled = free.response_ids[: sum(free.response_mask)]
        texts = [tiny_tokenizer.decode([t]) for t in sampled]
        i = next(i for i in range(1, len(texts) - 1) if len(texts[i].strip()) >= 2 and len(texts[i + 1].strip()) >= 2
                 and "\ufffd" not in texts[i] + texts[i + 1])
        stop = texts[i][-1] + texts[i + 1][:2]
        k = next(k for k in range(1, len(sampled) + 1) if stop in tiny_tokenizer.decode(sampled[:k]))
        for streamed in (False, True):
            t = asyncio.run(loop_with(program_with(stop, streamed)).run(row(), ctx, row_id="r0", group_id="g", seed=5))
            assert t.response_ids[: sum(t.response_mask)] == sampled[:k] and sum(t.response_mask) == k
            text = tiny_tokenizer.decode(sampled[:k])
            assert seen[(stop, streamed)] == (text[: text.index(stop)], None, "stop")
    finally:
        engine.close()

"""Qwen3-Coder / Qwen3.5 and GLM-4.5 tool calls (XML parameters typed by the tool's schema) with
their released chat templates, and the parse rate every run reports (``agentrl.agent.call_stats``)."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest
from agent_helpers import loop_with, make_row
from agent_helpers import run_rows as run
from family_fixtures import build_family_dir, family_template
from transformers import AutoTokenizer

from agentrl.agent.call_stats import count_turn, step_metrics
from agentrl.agent.families import cli_main, detect_tool_parser
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool_parsers import HermesToolParser, ParsedTurn, parse_turn
from agentrl.agent.xml_tool_parsers import Glm45ToolParser, Qwen3CoderToolParser
from agentrl.trainer.step import trajectory_metrics

TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"}, "opts": {"type": "object"},
    "items": {"type": "array"}, "maybe": {"type": ["integer", "null"]}, "s": {"type": "string"}}}}}
TYPED = {"n": 3, "x": 2.5, "flag": True, "opts": {"a": [1, "é"]}, "items": [1, 2], "maybe": None, "s": " 7 \nlines"}


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("xml_families")
    return {f: AutoTokenizer.from_pretrained(build_family_dir(f, root / f)) for f in ("qwen3-coder", "qwen3.5", "glm-4.6")}


def _rendered_calls(tok, family: str, calls: list[tuple[str, dict]]) -> str:
    """The text of ``calls`` in an assistant message as the family's own template renders it."""
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, message], tools=[TOOL], tokenize=False,
                                   chat_template=family_template(family))
    start = text.index("<tool_call>", text.rindex("assistant"))  # after the tools block's own example
    return text[start : text.rindex("</tool_call>") + len("</tool_call>")]


@pytest.mark.parametrize("family,parser", [("qwen3-coder", Qwen3CoderToolParser()), ("qwen3.5", Qwen3CoderToolParser()),
                                           ("glm-4.6", Glm45ToolParser())])
def test_typed_arguments_round_trip_through_the_released_template(family, parser, family_tokenizers):
    """Two calls as the template renders them (numbers, booleans, null, objects, arrays, strings
    with spaces and newlines) read back with the tool's schema: the same arguments, the same types."""
    tok = family_tokenizers[family]
    calls = [("f", TYPED), ("f", {"n": -12, "s": "x"})]
    text = _rendered_calls(tok, family, calls)
    assert text == parser.format_calls(calls)  # the parser writes what the template renders
    assert detect_tool_parser(tok) == {"glm-4.6": "glm45"}.get(family, "qwen3_coder")
    turn = parser.parse("Let me look.\n" + text, [TOOL])
    assert turn.content == "Let me look."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("f", TYPED, None), ("f", {"n": -12, "s": "x"}, None)]
    assert type(turn.calls[0].arguments["x"]) is float and type(turn.calls[0].arguments["n"]) is int
    # without the schemas (a tool the session does not offer) every value stays text
    [untyped, _] = parser.parse(text).calls
    assert untyped.arguments["n"] == "3" and untyped.arguments["opts"] == '{"a": [1, "é"]}'


@pytest.mark.parametrize("parser", [Qwen3CoderToolParser(), Glm45ToolParser()])
def test_a_value_not_of_its_declared_type_is_invalid_arguments_naming_the_parameter(parser):
    text = parser.format_calls([("f", {"s": 5, "n": "three", "extra": "4"})])
    [call] = parser.parse(text, [TOOL]).calls
    assert (call.name, call.error, call.arguments) == ("f", "invalid_arguments", None)
    assert call.detail == "invalid arguments for f: parameter 'n' must be integer, got 'three'"
    [ok] = parser.parse(parser.format_calls([("f", {"s": 5, "extra": "4"})]), [TOOL]).calls
    assert ok.arguments == {"s": "5", "extra": "4"}  # declared string, and undeclared: text as written


@pytest.mark.parametrize(
    "parser,text,detail",
    [
        (Qwen3CoderToolParser(), "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>", "not closed with </tool_call>"),
        (Qwen3CoderToolParser(), '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "must be <function=NAME>"),
        (Qwen3CoderToolParser(), "<tool_call>\n<function=f>\nn=1\n</function>\n</tool_call>", "text outside <parameter=KEY>"),
        (Qwen3CoderToolParser(), "<tool_call><function=f><parameter=n>1</parameter><parameter=n>2</parameter></function></tool_call>",
         "parameter 'n' is given twice"),
        (Glm45ToolParser(), "<tool_call>f\n<arg_key>n</arg_key>\n</tool_call>", "must be followed by <arg_value>"),
        (Glm45ToolParser(), "<tool_call>\n<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>", "must start with the function's name"),
    ],
)
def test_malformed_xml_calls_are_kept_with_their_error(parser, text, detail):
    [call] = parser.parse(text, [TOOL]).calls
    assert call.error == "bad_json" and detail in call.detail


def test_glm_check_template_passes_with_its_role_tokens_as_turn_ends(family_tokenizers, tmp_path, capsys):
    """GLM-4.5/4.6 templates write nothing after an assistant message: the model ends its turn with
    the next message's role token, <|observation|> after calls, <|user|> after an answer."""
    family_tokenizers["glm-4.6"].save_pretrained(tmp_path)
    for kwargs in ("{}", '{"enable_thinking": false}'):
        assert cli_main([str(tmp_path), "--kwargs", kwargs]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[:2] == ["check-template: OK", "  end-of-turn token: '<|user|>'"]
        assert "  tool parser: glm45" in out and "  token drift: none" in out


GLM_TWO_RESULTS = "\n<tool_response>\n408\n</tool_response>\n<tool_response>\n35\n</tool_response><|assistant|>"


@pytest.mark.parametrize("history,segments", [("as_template", 1), ("as_sampled", 0)])
def test_glm_two_calls_in_one_turn_then_an_interaction_retry(history, segments, family_tokenizers, make_ctx):
    """The call turn ends with <|observation|> and the answers with <|user|>, sampled; each observation
    is the template's rendering after that token. The retry's user turn drops the earlier reasoning:
    as_template starts a new segment there, as_sampled keeps one stream."""
    from agentrl_interactions.gsm8k import INCORRECT
    from test_history import requests_as_rendered

    tok = family_tokenizers["glm-4.6"]
    calls = Glm45ToolParser.format_calls([("calculator", {"expression": "12 * 34"}), ("calculator", {"expression": "5 * 7"})])
    script = ["\n<think>two products</think>\n" + calls + "<|observation|>", "\n<think>guess</think>\n#### 400",
              "\n<think>again</think>\n#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"history": history})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(
        [("r0", make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}))]))

    assert t.finish_reason == "interaction_done", t.reward_info
    assert [(c.arguments, c.result) for c in t.tool_calls] == [({"expression": "12 * 34"}, "408"), ({"expression": "5 * 7"}, "35")]
    assert len(t.earlier_segments) == segments and ctx.renderer.separator_ids == []
    observation, user = tok.convert_tokens_to_ids("<|observation|>"), tok.convert_tokens_to_ids("<|user|>")
    sampled = [tok.encode(script[0].removesuffix("<|observation|>"), add_special_tokens=False) + [observation],
               *(tok.encode(s, add_special_tokens=False) + [user] for s in script[1:])]
    segments_ = [*t.earlier_segments, t]
    assert [s.response_ids[x.start : x.end] for s in segments_ for x in s.turns if x.role == "assistant"] == sampled
    if history == "as_template":
        assert [r.input_ids for r in engine.requests] == requests_as_rendered(t, engine, tok, ctx.toolbox.schemas(["calculator"]), {})
        return
    retry = tok.encode(f"\n{INCORRECT}<|assistant|>", add_special_tokens=False)
    assert t.response_ids == sampled[0] + tok.encode(GLM_TWO_RESULTS, add_special_tokens=False) + sampled[1] + retry + sampled[2]
    assert t.prompt_ids == tok.encode(tok.apply_chat_template(t.messages[:2], tools=ctx.toolbox.schemas(["calculator"]),
                                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)


# ---------------------------------------------------------------------- exact streams: two calls, then an interaction's retry
QWEN_CODER_TWO_RESULTS = ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n35\n</tool_response>\n"
                          "<|im_end|>\n<|im_start|>assistant\n")
USER_RETRY = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_coder_two_calls_in_one_turn_then_an_interaction_retry_are_exact(family_tokenizers, make_ctx):
    from agentrl_interactions.gsm8k import INCORRECT

    tok = family_tokenizers["qwen3-coder"]
    calls = Qwen3CoderToolParser.format_calls([("calculator", {"expression": "12 * 34"}), ("calculator", {"expression": "5 * 7"})])
    script = [calls, "#### 400", "#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok)
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))

    assert t.finish_reason == "interaction_done", t.reward_info
    assert [(c.name, c.arguments, c.result) for c in t.tool_calls] == [
        ("calculator", {"expression": "12 * 34"}, "408"), ("calculator", {"expression": "5 * 7"}, "35")]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = [tok.encode(s, add_special_tokens=False) + [eot] for s in script]
    observed = [tok.encode(QWEN_CODER_TWO_RESULTS, add_special_tokens=False), tok.encode(USER_RETRY.format(INCORRECT), add_special_tokens=False)]
    assert t.response_ids == sampled[0] + observed[0] + sampled[1] + observed[1] + sampled[2] + ctx.renderer.separator_ids
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert t.response_mask == ([1] * len(sampled[0]) + [0] * len(observed[0]) + [1] * len(sampled[1]) + [0] * len(observed[1])
                               + [1] * len(sampled[2]) + [0] * len(ctx.renderer.separator_ids))
    # append-only: the stream is also the template's rendering of the messages through the last answer
    last = max(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
    final = tok.apply_chat_template(t.messages[: last + 1], tools=ctx.toolbox.schemas(["calculator"]), tokenize=False)
    assert t.prompt_ids + t.response_ids == tok.encode(final, add_special_tokens=False)
    assert (t.metrics["tool_calls/parsed"], t.metrics.get("tool_calls/unparsed_turns", 0.0)) == (2.0, 0.0)


def test_qwen3_5_two_calls_in_one_turn_are_exact_with_reasoning_kept(family_tokenizers, make_ctx):
    tok = family_tokenizers["qwen3.5"]
    calls = Qwen3CoderToolParser.format_calls([("calculator", {"expression": "12 * 34"}), ("calculator", {"expression": "5 * 7"})])
    script = ["two products\n</think>\n\n" + calls, "done\n</think>\n\n#### 408"]  # the generation prompt opened <think>
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))

    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    assert [c.result for c in t.tool_calls] == ["408", "35"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    results = ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n35\n</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n<think>\n")
    assert t.response_ids == (tok.encode(script[0], add_special_tokens=False) + [eot] + tok.encode(results, add_special_tokens=False)
                              + tok.encode(script[1], add_special_tokens=False) + [eot] + ctx.renderer.separator_ids)
    assert engine.requests[0].input_ids == t.prompt_ids and tok.decode(t.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")


# ---------------------------------------------------------------------- the parse rate
def test_every_turn_counts_its_calls_parsed_malformed_and_unparsed(family_tokenizers, make_ctx):
    tok = family_tokenizers["qwen3-coder"]
    fmt = Qwen3CoderToolParser.format_calls
    script = [
        fmt([("calculator", {"expression": "12 * 34"}), ("nope", {"q": "1"})]),  # parsed; unknown_tool
        HermesToolParser.format_calls([("calculator", {"expression": "1"})]),  # JSON inside <tool_call>: bad_json
        "I would call <function=calculator> here.\n#### 408",  # a call marker and no call: an unparsed attempt
    ]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))
    assert {k: v for k, v in t.metrics.items() if k.startswith("tool_calls/")} == {
        "tool_calls/parsed": 1.0, "tool_calls/malformed/unknown_tool": 1.0, "tool_calls/malformed/bad_json": 1.0,
        "tool_calls/unparsed_turns": 1.0}
    m = trajectory_metrics([t, t])
    assert (m["tool_calls/parsed"], m["tool_calls/malformed/unknown_tool"], m["tool_calls/unparsed_turns"]) == (2.0, 2.0, 2.0)
    assert m["tool_calls/malformed_rate"] == pytest.approx(4 / 6) and m["tool_calls/unparsed_turn_rate"] == pytest.approx(2 / 6)


def test_invalid_arguments_count_by_the_schema_and_no_calls_give_zero_rates():
    counts: Counter[str] = Counter()
    parser = Qwen3CoderToolParser()
    text = parser.format_calls([("f", {"n": "x"}), ("f", {"opts": [1]}), ("f", {"n": 1})])
    count_turn(counts, parser, text, parser.parse(text, [TOOL]), [TOOL])
    assert counts == Counter({"tool_calls/malformed/invalid_arguments": 2, "tool_calls/parsed": 1})
    assert step_metrics([]) == {"tool_calls/parsed": 0.0, "tool_calls/unparsed_turns": 0.0, "tool_calls/malformed_rate": 0.0,
                                "tool_calls/unparsed_turn_rate": 0.0}


def test_a_parser_written_for_text_alone_still_parses():
    class OneArgument:
        call_marker = "CALL"

        def parse(self, text):
            return ParsedTurn(content=text)

    assert parse_turn(OneArgument(), "CALL me", [TOOL]).content == "CALL me"
    counts: Counter[str] = Counter()
    count_turn(counts, OneArgument(), "CALL me", ParsedTurn(content="CALL me"), [TOOL])
    assert counts == Counter({"tool_calls/unparsed_turns": 1})


def test_the_openai_endpoint_counts_the_parse_rate_of_its_answers(family_tokenizers, make_ctx):
    from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

    tok = family_tokenizers["qwen3-coder"]
    bad = Qwen3CoderToolParser.format_calls([("calculator", {"expr": "1"})])  # a parameter the schema does not have
    good = Qwen3CoderToolParser.format_calls([("calculator", {"expression": "12 * 34"})])
    engine = ScriptedEngine(tok, {"r0": [bad, good, "<function=calculator>\n#### 408"]})
    ctx = make_ctx(engine, tokenizer=tok)

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        for _ in range(3):
            answer = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message
            messages.append(answer.model_dump(exclude_none=True))
            for call in answer.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "408"})
            if not answer.tool_calls and answer.content and "####" in answer.content:
                return answer.content
            if not answer.tool_calls:
                messages.append({"role": "user", "content": "Try again."})
        return ""

    (t,) = run(loop_with(program), ctx, [("r0", make_row(agent="openai_agent"))])
    assert {k: v for k, v in t.metrics.items() if k.startswith("tool_calls/")} == {
        "tool_calls/malformed/invalid_arguments": 1.0, "tool_calls/parsed": 1.0, "tool_calls/unparsed_turns": 1.0}


def test_replay_show_and_the_report_show_the_parse_rate(family_tokenizers, make_ctx):
    from agentrl.data.rollout_store import StoredTrajectory
    from agentrl.replay.cli import format_trajectory
    from agentrl.report import _plots

    tok = family_tokenizers["qwen3-coder"]
    script = [Qwen3CoderToolParser.format_calls([("nope", {"q": "1"})]), "<function=calculator> #### 408"]
    ctx = make_ctx(ScriptedEngine(tok, {"r0": script}), tokenizer=tok)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))
    shown = format_trajectory(StoredTrajectory("train", 0, 0, t, None), tok.decode).splitlines()
    assert "  tool calls: 0 parsed, 1 malformed (unknown_tool 1); 1 of 2 assistant turns with a call marker and no call read" in shown
    rows = [{"step": s, **trajectory_metrics([t])} for s in (1, 2)]
    [plot] = [svg for svg in _plots(rows) if 'aria-label="tool-call parse rate"' in svg]
    assert "tool_calls/malformed_rate" in plot and "tool_calls/unparsed_turn_rate" in plot


@pytest.mark.parametrize("history,segments", [("as_template", 1), ("as_sampled", 0)])
def test_qwen3_5_two_calls_then_an_interaction_retry(history, segments, family_tokenizers, make_ctx):
    """Qwen3.5 keeps reasoning only after the last user message: the retry's user turn drops the
    earlier blocks. as_template: every request is the template's rendering (one new segment at the
    retry); as_sampled: one stream, sampled tokens plus the template's rendering of each observation."""
    from agentrl_interactions.gsm8k import INCORRECT
    from test_history import assert_each_sampled_turn_once_verbatim, requests_as_rendered

    tok = family_tokenizers["qwen3.5"]
    calls = Qwen3CoderToolParser.format_calls([("calculator", {"expression": "12 * 34"}), ("calculator", {"expression": "5 * 7"})])
    script = ["two products\n</think>\n\n" + calls, "guess\n</think>\n\n#### 400", "again\n</think>\n\n#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"history": history})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(
        [("r0", make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}))]))

    assert t.finish_reason == "interaction_done", t.reward_info
    assert [c.result for c in t.tool_calls] == ["408", "35"] and t.metrics["tool_calls/parsed"] == 2.0
    assert len(t.earlier_segments) == segments
    assert_each_sampled_turn_once_verbatim(t, tok, script)
    if history == "as_template":
        assert [r.input_ids for r in engine.requests] == requests_as_rendered(t, engine, tok, ctx.toolbox.schemas(["calculator"]), {})
        return
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    results = ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n35\n</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n<think>\n")
    retry = f"\n<|im_start|>user\n{INCORRECT}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    sampled = [tok.encode(s, add_special_tokens=False) + [eot] for s in script]
    assert t.response_ids == (sampled[0] + tok.encode(results, add_special_tokens=False) + sampled[1]
                              + tok.encode(retry, add_special_tokens=False) + sampled[2] + ctx.renderer.separator_ids)


def test_glm_through_the_openai_endpoint_is_exact(family_tokenizers, make_ctx):
    """A program's GLM conversation: the call turn ends with <|observation|>, the tool result is the
    template's rendering after it, the answer ends with <|user|>; the calls come back typed."""
    from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

    tok = family_tokenizers["glm-4.6"]
    call = "\n<think>use it</think>\n" + Glm45ToolParser.format_calls([("calculator", {"expression": "12 * 34"})]) + "<|observation|>"
    engine = ScriptedEngine(tok, {"r0": [call, "\n<think>done</think>\n#### 408"]})
    ctx = make_ctx(engine, tokenizer=tok)

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        first = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message
        [tool_call] = first.tool_calls
        messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tool_call.id, "content": "408"}]
        return client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", make_row(agent="openai_agent"))])
    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    observation, user = tok.convert_tokens_to_ids("<|observation|>"), tok.convert_tokens_to_ids("<|user|>")
    sampled = [tok.encode(call.removesuffix("<|observation|>"), add_special_tokens=False) + [observation],
               tok.encode("\n<think>done</think>\n#### 408", add_special_tokens=False) + [user]]
    result = tok.encode("\n<tool_response>\n408\n</tool_response><|assistant|>", add_special_tokens=False)
    assert t.response_ids == sampled[0] + result + sampled[1]
    assert t.response_mask == [1] * len(sampled[0]) + [0] * len(result) + [1] * len(sampled[1])
    assert t.metrics["tool_calls/parsed"] == 1.0 and t.metrics["segment_splits"] == 0

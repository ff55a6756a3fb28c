"""gpt-oss (harmony): the parser, stops, renderer and check-template on the released chat template
with the family's special tokens around a stand-in vocabulary (``family_fixtures``).

The episodes run through the real ``tool_agent`` loop with a scripted engine writing harmony turns;
every request must be the tokenizer's ``apply_chat_template`` of the messages so far wherever the
template keeps the history, and each observation exactly the template's rendering of it.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from agent_helpers import make_row
from family_fixtures import build_family_dir
from transformers import AutoTokenizer

from agentrl.agent.families import check_template, cli_main, detect_tool_parser, family_renderer, stop_tokens
from agentrl.agent.harmony import HarmonyRenderer, HarmonyToolParser
from agentrl.agent.render import TemplateUnsupported
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine

P = HarmonyToolParser
ARGS = '{"expression": "12 * 34"}'


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return build_family_dir("gpt-oss", tmp_path_factory.mktemp("gpt-oss") / "gpt-oss")


@pytest.fixture(scope="module")
def tok(gpt_oss_dir):
    return AutoTokenizer.from_pretrained(gpt_oss_dir)


# ---------------------------------------------------------------------- the parser
@pytest.mark.parametrize("header", [
    " to=functions.calculator<|channel|>commentary json",  # role header, as the template renders a call
    " to=functions.calculator<|channel|>commentary <|constrain|>json",
    "<|channel|>commentary to=functions.calculator <|constrain|>json",  # channel header, as the model often writes it
    "<|channel|>commentary to=functions.calculator",
])
def test_a_call_is_read_wherever_its_recipient_sits(header):
    turn = P().parse(P.format_analysis("need 12 * 34") + header + "<|message|>" + ARGS)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("calculator", {"expression": "12 * 34"}, None)]
    assert turn.content == "need 12 * 34" and turn.final_answer is None
    assert turn.calls[0].result_message("408") == {"role": "tool", "content": "408", "name": "calculator"}


def test_an_answer_is_the_final_channel_and_plain_text_is_content():
    turn = P().parse(P.format_analysis("easy") + P.format_answer("#### 408\n"))
    assert (turn.content, turn.final_answer, turn.calls) == ("#### 408\n", "#### 408\n", [])
    assert P().parse("#### 408") .content == "#### 408"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + P.format_calls([("calculator", {"expression": "1"})])
    assert P().parse(preamble).content == "Checking."


@pytest.mark.parametrize("text,name,detail", [
    (' to=functions.calculator<|channel|>commentary json<|message|>{"expression": ', "calculator",
     "the arguments of functions.calculator are not valid JSON (Expecting value at position 15)"),
    (" to=functions.calculator<|channel|>commentary json<|message|>[1]", "calculator", "arguments must be a JSON object"),
    ("<|channel|>commentary <|constrain|>json<|message|>" + ARGS, None, "the tool call names no function: write the recipient as to=functions.NAME"),
    (" to=functions.<|channel|>commentary json<|message|>" + ARGS, None, "the tool call names no function: write the recipient as to=functions.NAME"),
    ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}', None,
     "the recipient 'browser.search' is a built-in tool; call a function as to=functions.NAME"),
    (" to=functions.calculator<|channel|>commentary json", "calculator", "the tool call has no <|message|> with its arguments"),
])
def test_malformed_calls_are_kept_with_their_error(text, name, detail):
    [call] = P().parse(text).calls
    assert (call.name, call.error, call.detail) == (name, "bad_json", detail)


def test_a_second_call_in_one_turn_is_malformed():
    one = P.format_calls([("calculator", {"expression": "1"})])
    first, second = P().parse(one + "<|end|><|start|>assistant" + one).calls
    assert first.error is None and (second.name, second.error) == ("calculator", "bad_json")
    assert second.detail == "a gpt-oss turn makes one tool call: it ends with <|call|>"
    with pytest.raises(ValueError, match="one tool call"):
        P.format_calls([("a", {}), ("b", {})])


def test_a_tool_message_addressed_to_the_assistant_is_not_a_call():
    assert P().parse('<|channel|>final<|message|>x<|end|><|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"1"').calls == []


# ---------------------------------------------------------------------- family detection, stops, renderer
def test_the_family_gets_the_harmony_parser_renderer_and_stops(tok):
    renderer = family_renderer(tok)
    assert type(renderer) is HarmonyRenderer and detect_tool_parser(tok) == "harmony"
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>", "<|end|>")}
    stops = stop_tokens(tok)
    assert stops.ids == (ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]) and stops.end_of_turn == "<|return|>"
    assert stops.sources[ids["<|call|>"]] == ("chat template end of a tool call '<|call|>'", "generation_config.json eos_token_id")
    assert (renderer.separator_ids, renderer.append_only, renderer.tool_message_problem, renderer.prompt_move) == ([], False, None, None)
    with pytest.raises(TemplateUnsupported, match="the tool message needs 'name'"):
        renderer.observation_text([{"role": "tool", "content": "408"}])


# ---------------------------------------------------------------------- episodes through the real loop
def _episode(tok, make_ctx, script, *, history, **row_kwargs):
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"history": history})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row(**row_kwargs))]))
    return t, ctx, engine


def _rendered(tok, ctx, messages, *, generation=True):
    text = tok.apply_chat_template(messages, tools=ctx.toolbox.schemas(["calculator"]), add_generation_prompt=generation, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _requests_before(messages):
    """The conversation each request saw: through every message that an assistant turn follows."""
    return [k for k in range(2, len(messages) + 1) if k == len(messages) or messages[k]["role"] == "assistant"][: -1]


def _tool_turn(result):
    return f'<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"{result}"<|end|><|start|>assistant'


@pytest.mark.parametrize("analysis", [True, False])
def test_two_calls_and_an_answer_are_the_templates_rendering_token_for_token(analysis, tok, make_ctx):
    think = P.format_analysis if analysis else (lambda text: "")
    script = [
        think("Multiply first.") + P.format_calls([("calculator", {"expression": "12 * 34"})]) + "<|call|>",
        think("Check it.") + P.format_calls([("calculator", {"expression": "408 + 0"})]) + "<|call|>",
        think("Done.") + P.format_answer("#### 408"),
    ]
    t, ctx, engine = _episode(tok, make_ctx, script, history="as_template")
    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    assert [(c.name, c.arguments, c.result) for c in t.tool_calls] == [
        ("calculator", {"expression": "12 * 34"}, "408"), ("calculator", {"expression": "408 + 0"}, "408")]
    call, ret = tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")
    sampled = [tok.encode(script[0], add_special_tokens=False), tok.encode(script[1], add_special_tokens=False),
               tok.encode(script[2], add_special_tokens=False) + [ret]]
    assert sampled[0][-1] == sampled[1][-1] == call
    tool = tok.encode(_tool_turn("408"), add_special_tokens=False)
    assert t.response_ids == sampled[0] + tool + sampled[1] + tool + sampled[2]
    assert t.response_mask == [1] * len(sampled[0]) + [0] * len(tool) + [1] * len(sampled[1]) + [0] * len(tool) + [1] * len(sampled[2])
    assert t.earlier_segments == [] and [r.sampling.stop_token_ids for r in engine.requests] == [stop_tokens(tok).ids] * 3
    # every request is the template's rendering of the messages so far (the analysis of a call is
    # kept while no answer follows it)
    assert [r.input_ids for r in engine.requests] == [_rendered(tok, ctx, t.messages[:k]) for k in _requests_before(t.messages)]
    assert t.messages[2]["content"] == ("Multiply first." if analysis else "") and "name" in t.messages[3]
    final = _rendered(tok, ctx, t.messages, generation=False)  # as training renders a finished conversation
    if analysis:  # the template drops the analysis of turns before the answer (the answer's own is not in the message)
        assert final == tok.encode(tok.decode(t.prompt_ids + t.response_ids).replace("<|channel|>analysis<|message|>Multiply first.<|end|><|start|>assistant", "")
                                   .replace("<|channel|>analysis<|message|>Check it.<|end|><|start|>assistant", "")
                                   .replace("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant", ""), add_special_tokens=False)
    else:
        assert t.prompt_ids + t.response_ids == final


RETRY = [
    P.format_analysis("Use the tool.") + P.format_calls([("calculator", {"expression": "12 * 34"})]) + "<|call|>",
    P.format_analysis("Got it.") + P.format_answer("#### 400"),
    P.format_analysis("Recheck.") + P.format_answer("#### 408"),
]


def test_a_call_then_an_interaction_retry_as_sampled_keeps_one_stream(tok, make_ctx):
    from agentrl_interactions.gsm8k import INCORRECT

    t, ctx, engine = _episode(tok, make_ctx, RETRY, history="as_sampled", interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    assert t.finish_reason == "interaction_done" and t.earlier_segments == []
    sampled = [tok.encode(RETRY[0], add_special_tokens=False)] + [tok.encode(s, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|return|>")] for s in RETRY[1:]]
    tool = tok.encode(_tool_turn("408"), add_special_tokens=False)
    user = tok.encode(f"<|start|>user<|message|>{INCORRECT}<|end|><|start|>assistant", add_special_tokens=False)
    assert t.response_ids == sampled[0] + tool + sampled[1] + user + sampled[2]
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant", "user", "assistant"]
    before = _requests_before(t.messages)
    assert [r.input_ids for r in engine.requests[:2]] == [_rendered(tok, ctx, t.messages[:k]) for k in before[:2]]
    # the third request keeps the stream as sampled; the template renders the history otherwise:
    # the answer ends with <|end|>, not the sampled <|return|>, and earlier analysis is dropped
    stream = tok.decode(engine.requests[2].input_ids)
    rewritten = re.sub(r"<\|channel\|>analysis<\|message\|>[^<]*<\|end\|><\|start\|>assistant", "", stream).replace("#### 400<|return|>", "#### 400<|end|>")
    assert stream != rewritten and _rendered(tok, ctx, t.messages[: before[2]]) == tok.encode(rewritten, add_special_tokens=False)


def test_a_call_then_an_interaction_retry_as_template_starts_a_segment_at_the_rewrite(tok, make_ctx):
    t, ctx, engine = _episode(tok, make_ctx, RETRY, history="as_template", interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    assert t.finish_reason == "interaction_done"
    before = _requests_before(t.messages)
    assert [r.input_ids for r in engine.requests] == [_rendered(tok, ctx, t.messages[:k]) for k in before]
    [earlier] = t.earlier_segments  # the call, its result and the first answer, as sampled (<|return|> kept)
    assert earlier.prompt_ids == engine.requests[0].input_ids
    assert earlier.response_ids[-1] == tok.convert_tokens_to_ids("<|return|>")
    assert t.prompt_ids == engine.requests[2].input_ids
    assert t.response_ids == tok.encode(RETRY[2], add_special_tokens=False) + [tok.convert_tokens_to_ids("<|return|>")]


@pytest.mark.parametrize("history", ["as_template", "as_sampled"])
def test_a_call_in_the_models_own_header_is_rewritten_by_the_template(history, tok, make_ctx):
    """gpt-oss often writes the recipient in the channel header and compact JSON; the template
    renders the call in its own header: as_template starts a segment at the result, as_sampled
    keeps the call as sampled."""
    own = '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression":"12 * 34"}<|call|>'
    t, ctx, engine = _episode(tok, make_ctx, [own, P.format_answer("#### 408")], history=history)
    assert t.reward == 1.0 and t.tool_calls[0].arguments == {"expression": "12 * 34"}
    stream = engine.requests[0].input_ids + tok.encode(own + _tool_turn("408"), add_special_tokens=False)
    fresh = _rendered(tok, ctx, t.messages[:4])
    assert fresh == tok.encode(tok.decode(stream).replace(own, P.format_calls([("calculator", {"expression": "12 * 34"})]) + "<|call|>"),
                               add_special_tokens=False)
    assert engine.requests[1].input_ids == (fresh if history == "as_template" else stream)
    assert len(t.earlier_segments) == (history == "as_template")


# ---------------------------------------------------------------------- check-template
def test_check_template_passes_and_reports_the_rewrite(tok, gpt_oss_dir, capsys):
    report = check_template(tok, model_dir=gpt_oss_dir)
    assert report.ok and report.drift is None and report.tools == "ok" and report.round_trip == "ok", report.render()
    assert report.parser == "harmony" and report.end_of_turn == "<|return|>" and not report.append_only
    assert cli_main([str(gpt_oss_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("check-template: OK\n") and "  tool parser: harmony\n" in out
    assert "(chat template end of a tool call '<|call|>'; generation_config.json eos_token_id)" in out
    assert "  note: gpt-oss: a final answer the model ended with <|return|> is rendered with <|end|>" in out


# ---------------------------------------------------------------------- agent programs (the OpenAI endpoint)
def test_an_openai_clients_tool_result_is_named_after_its_call(tok, make_ctx):
    """An OpenAI client's tool message has no ``name``; the template names the result after the
    call it answers, and so does the endpoint's observation."""
    import openai
    from agent_helpers import loop_with
    from agent_helpers import run_rows as run

    from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

    script = [RETRY[0], P.format_answer("#### 408")]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"history": "as_template"})

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        first = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message
        [call] = first.tool_calls
        messages += [first, {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        return client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR]).choices[0].message.content

    (t,) = run(loop_with(program), ctx, [("r0", make_row(agent="openai_agent"))])
    assert t.reward == 1.0 and t.metrics["segment_splits"] == 0, t.reward_info
    sampled = tok.encode(script[0], add_special_tokens=False)
    tool = tok.encode(_tool_turn("408"), add_special_tokens=False)
    assert t.response_ids == sampled + tool + tok.encode(script[1], add_special_tokens=False) + [tok.convert_tokens_to_ids("<|return|>")]
    assert engine.requests[1].input_ids == t.prompt_ids + sampled + tool

"""Real model families: exact tokens, native tool calls and end-of-turn stops (issue 19).

Each family is its released chat template with its exact special tokens around a stand-in
vocabulary (``family_fixtures``). The same multi-turn tool conversation runs through the real
``tool_agent`` loop for each, with a scripted engine emitting the family's own tool-call text;
the token ids of the trajectory must be exactly what was sampled plus the template's rendering
of each observation, written out here by hand from each template.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from agent_helpers import make_row
from family_fixtures import FAMILIES, REAL_VOCAB_FAMILIES, build_family_dir, family_template
from transformers import AutoTokenizer

from agentrl.agent.families import check_template, cli_main, detect_tool_parser, stop_tokens
from agentrl.agent.render import ChatRenderer, TemplateUnsupported
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool_parsers import (
    DeepSeekR1ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Phi4MiniToolParser,
)
from agentrl.agent.xml_tool_parsers import Qwen3CoderToolParser
from agentrl.errors import ConfigError

CALL = [("calculator", {"expression": "12 * 34"})]
QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
LLAMA_TOOL = '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'

# family -> (template kwargs, parser, the call text the model writes, the tool result's rendering,
#            stop tokens (end-of-turn first), append-only)
TOOL_FAMILIES = {
    "qwen3": ({}, "hermes", HermesToolParser.format_calls(CALL), QWEN_TOOL, ["<|im_end|>", "<|endoftext|>"], False),
    "qwen3-no-thinking": (
        {"enable_thinking": False}, "hermes", HermesToolParser.format_calls(CALL), QWEN_TOOL + "<think>\n\n</think>\n\n",
        ["<|im_end|>", "<|endoftext|>"], False,
    ),
    "qwen2.5": ({}, "hermes", HermesToolParser.format_calls(CALL), QWEN_TOOL, ["<|im_end|>", "<|endoftext|>"], True),
    "llama3.1": ({}, "llama3_json", Llama3JsonToolParser.format_calls(CALL), LLAMA_TOOL, ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], True),
    "llama3.2": ({}, "llama3_json", Llama3JsonToolParser.format_calls(CALL), LLAMA_TOOL, ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], True),
    "mistral-nemo": (
        {}, "mistral", MistralToolParser.format_calls(CALL), '[TOOL_RESULTS]{"content": 408, "call_id": "{id}"}[/TOOL_RESULTS]', ["</s>"], False,
    ),
    "phi4-mini": ({}, "phi4_mini", Phi4MiniToolParser.format_calls(CALL), "<|tool|>408<|end|><|assistant|>", ["<|end|>", "<|endoftext|>"], False),
    "smollm2": ({}, "hermes", HermesToolParser.format_calls(CALL), "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", ["<|im_end|>"], True),
    "smollm3": (
        {}, "hermes", HermesToolParser.format_calls(CALL), "\n<|im_start|>user\n408<|im_end|>\n<|im_start|>assistant\n",
        ["<|im_end|>", "<|end_of_text|>"], True,
    ),
    "qwen3-coder": (
        {}, "qwen3_coder", Qwen3CoderToolParser.format_calls(CALL),
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n", ["<|im_end|>", "<|endoftext|>"], True,
    ),
    # the generation prompt opens the <think> block: the model writes the rest of it
    "qwen3.5": ({}, "qwen3_coder", Qwen3CoderToolParser.format_calls(CALL), QWEN_TOOL + "<think>\n", ["<|im_end|>", "<|endoftext|>"], False),
    "qwen3.5-no-thinking": (
        {"enable_thinking": False}, "qwen3_coder", Qwen3CoderToolParser.format_calls(CALL), QWEN_TOOL + "<think>\n\n</think>\n\n",
        ["<|im_end|>", "<|endoftext|>"], False,
    ),
    "smollm3-no-thinking": (
        {"enable_thinking": False}, "hermes", HermesToolParser.format_calls(CALL),
        "\n<|im_start|>user\n408<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n", ["<|im_end|>", "<|end_of_text|>"], True,
    ),
}
# families whose templates cannot show tool results exactly: refused for tool_agent, with the reason
REFUSED = {
    "gemma2": "Conversation roles must alternate",
    "gemma3": "Conversation roles must alternate",
    "phi3.5": "drops messages with role 'tool'",
    "deepseek-r1-distill-qwen": "after an earlier round of tool results",
}
# GLM-4.5/4.6: a turn ends with the role token of the message that follows (<|observation|> before
# tool results, <|user|> otherwise), tested in test_xml_tool_calls.py
GLM = {"glm-4.6"}


# gpt-oss: harmony turns (a call ends with <|call|>, an answer with <|return|>), tested in test_harmony.py
HARMONY = {"gpt-oss"}


REAL = "+real"  # a case suffix: the family's released vocabulary instead of the stand-in


def _base(case: str) -> str:
    return case.removesuffix(REAL)


def _family(case: str) -> str:
    return _base(case).removesuffix("-no-thinking")


def _key(case: str) -> str:
    """The tokenizer a case runs on: the family's stand-in, or ``family+real``."""
    return _family(case) + (REAL if case.endswith(REAL) else "")


def assert_the_prompt_is_where_the_template_puts_it(t, engine, tok, tools, kwargs, script) -> None:
    """A template that moves its prompt (Mistral-Nemo writes the system message and the tools
    block before the *last* user turn, and drops the system message once tool results end the
    conversation): each segment starts from the template's own rendering of the conversation so
    far, every request continues its segment's stream, and the template's rendering at every
    request starts with that segment's prompt (the prompt is where the template puts it; the
    turns since are exact as sampled, as with every template). The segments hold each sampled
    turn once, verbatim and trained."""
    messages = t.messages
    before = [i for i, m in enumerate(messages) if m["role"] == "assistant"]  # a request made each assistant turn
    assert len(before) == len(engine.requests) == len(script)
    rendered = [tok.encode(tok.apply_chat_template(messages[:end], tools=tools, add_generation_prompt=True, tokenize=False,
                                                   **kwargs), add_special_tokens=False) for end in before]
    segments = [*t.earlier_segments, t]
    assert len(segments) >= 2
    starts = [rendered.index(seg.prompt_ids) for seg in segments]  # each segment's prompt is a fresh rendering
    assert starts[0] == 0 and starts == sorted(set(starts))
    for k, request in enumerate(engine.requests):
        seg = segments[max(i for i, start in enumerate(starts) if start <= k)]
        P = len(seg.prompt_ids)
        assert request.input_ids[:P] == seg.prompt_ids == rendered[k][:P]
        assert request.input_ids[P:] == seg.response_ids[: len(request.input_ids) - P]
    sampled = [s.response_ids[x.start : x.end] for s in segments for x in s.turns if x.role == "assistant"]
    eot = stop_tokens(tok).ids[0]
    assert sampled == [tok.encode(text, add_special_tokens=False) + [eot] for text in script]
    assert all(m == 1 for s in segments for x in s.turns if x.role == "assistant" for m in s.response_mask[x.start : x.end])


def _with_real(cases) -> list[str]:
    """Each case, and again on the released vocabulary where the family has one: real merges join
    text across the boundaries the template puts between turns, which the stand-in rarely does."""
    cases = list(cases)
    return cases + [c + REAL for c in cases if _family(c) in REAL_VOCAB_FAMILIES]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {name: build_family_dir(name, root / name) for name in FAMILIES}
    dirs |= {name + REAL: build_family_dir(name, root / (name + REAL), real_vocab=True) for name in REAL_VOCAB_FAMILIES}
    return dirs


@pytest.fixture(scope="module")
def tokenizers(family_dirs):
    return {name: AutoTokenizer.from_pretrained(path) for name, path in family_dirs.items()}


def test_every_family_in_the_fixtures_is_covered():
    assert {_family(c) for c in TOOL_FAMILIES} | set(REFUSED) | GLM | HARMONY == set(FAMILIES)


@pytest.mark.parametrize("family", REAL_VOCAB_FAMILIES)
def test_real_vocabularies_encode_as_rank_bpe(family, tokenizers):
    """The released vocabularies are converted faithfully: the tokenizer built from each rank file
    encodes like an independent rank-based BPE encoder, and its special tokens sit at the released ids."""
    from real_vocab import reference_encode

    tok = tokenizers[family + REAL]
    text = "Natalia sold 48/2 = 24 clips in May.\n\n  naïve café — 北京 don't WE'LL {\"x\": 12345}\t\r\n#### 72"
    assert tok.encode(text, add_special_tokens=False) == reference_encode(family, text)
    released = {"qwen3": ("<|im_end|>", 151645), "qwen2.5": ("<tool_call>", 151657), "llama3.1": ("<|eot_id|>", 128009),
                "llama3.2": ("<|python_tag|>", 128010), "mistral-nemo": ("[TOOL_CALLS]", 9)}[family]
    assert tok.convert_tokens_to_ids(released[0]) == released[1]
    assert tok.encode("Hello world", add_special_tokens=False) == {
        "qwen3": [9707, 1879], "qwen2.5": [9707, 1879], "llama3.1": [9906, 1917], "llama3.2": [9906, 1917], "mistral-nemo": [22177, 4304],
    }[family]


# ---------------------------------------------------------------------- the multi-turn tool conversation
@pytest.mark.parametrize("case", _with_real(TOOL_FAMILIES))
def test_tool_conversation_is_sampled_ids_plus_the_templates_rendering_of_each_observation(case, tokenizers, make_ctx):
    kwargs, parser, call_text, tool_text, stops, append_only = TOOL_FAMILIES[_base(case)]
    tok = tokenizers[_key(case)]
    think = "<think>\nmultiply\n</think>\n\n" if "<think>" in tok.chat_template and kwargs.get("enable_thinking") is not False else ""
    if think and tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False).endswith("<think>\n"):
        think = think.removeprefix("<think>\n")  # Qwen3.5's generation prompt opens the block
    script = [think + "Let me compute.\n" + call_text if parser == "hermes" else call_text, think + "#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    # the append-only stream (agent.history=as_sampled); every request as the template renders it
    # (as_template, where templates that rewrite the history start segments): tests/agent/test_history.py
    ctx = make_ctx(engine, tokenizer=tok, agent={"chat_template_kwargs": kwargs, "history": "as_sampled"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))

    assert type(ctx.parser).__name__ == {
        "hermes": "HermesToolParser", "llama3_json": "Llama3JsonToolParser", "mistral": "MistralToolParser", "phi4_mini": "Phi4MiniToolParser",
        "qwen3_coder": "Qwen3CoderToolParser",
    }[parser]
    stop_ids = tuple(tok.convert_tokens_to_ids(s) for s in stops)
    assert ctx.sampling.stop_token_ids == stop_ids and engine.requests[0].sampling.stop_token_ids == stop_ids
    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    [call] = t.tool_calls
    assert (call.name, call.arguments, call.result, call.error) == ("calculator", {"expression": "12 * 34"}, "408", None)
    assert (ctx.renderer.prompt_move is not None) is (parser == "mistral")  # the row has a system message

    eot = stop_ids[0]
    first, tool, second = (t.response_ids[x.start : x.end] for x in t.turns)
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant"]
    # sampled tokens verbatim (the scripted engine's encoding, ended by the end-of-turn token)
    assert first == tok.encode(script[0], add_special_tokens=False) + [eot]
    assert second == tok.encode(script[1], add_special_tokens=False) + [eot]
    if parser == "mistral":  # the id the parser generated, in Mistral's format, in both messages
        call_id = t.messages[-3]["tool_calls"][0]["id"]
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id) and t.messages[-2]["tool_call_id"] == call_id
        tool_text = tool_text.replace("{id}", call_id)
    assert tok.decode(tool) == tool_text
    assert tool == tok.encode(tool_text, add_special_tokens=False)
    assert engine.requests[1].input_ids == t.prompt_ids + first + tool
    assert t.response_ids == first + tool + second + ctx.renderer.separator_ids
    assert t.response_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second) + [0] * len(ctx.renderer.separator_ids)
    # the prompt is the template's own rendering
    reference_prompt = tok.apply_chat_template(
        t.messages[:2], tools=ctx.toolbox.schemas(["calculator"]), add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert t.prompt_ids == tok.encode(reference_prompt, add_special_tokens=False)
    assert ctx.renderer.append_only is append_only
    if append_only and not think and "tool_calls" in tok.chat_template:
        # a template that renders the calls: the stream is also a fresh rendering of the final messages
        final = tok.apply_chat_template(t.messages, tools=ctx.toolbox.schemas(["calculator"]), tokenize=False, **kwargs)
        assert t.prompt_ids + t.response_ids == tok.encode(final, add_special_tokens=False)


@pytest.mark.parametrize("case", _with_real(c for c in TOOL_FAMILIES if "<think>" in family_template(_family(c))))
def test_reasoning_blocks_stay_in_the_trajectory_as_sampled(case, tokenizers, make_ctx):
    kwargs, parser, call_text, *_ = TOOL_FAMILIES[_base(case)]
    tok = tokenizers[_key(case)]
    script = ["<think>\n12 * 34 needs the tool\n</think>\n\n" + call_text, "<think>\ndone\n</think>\n\n#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"chat_template_kwargs": kwargs, "history": "as_sampled"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))
    first = t.response_ids[t.turns[0].start : t.turns[0].end]
    assert tok.decode(first).startswith("<think>\n12 * 34 needs the tool\n</think>\n\n")
    assert t.tool_calls[0].name == "calculator" and t.finish_reason == "stop"


@pytest.mark.parametrize("family,reason", list(REFUSED.items()))
def test_families_that_cannot_show_tool_results_are_refused_at_startup_with_the_reason(family, reason, tokenizers, make_ctx):
    tok = tokenizers[family]
    with pytest.raises(ConfigError, match=r"agent.default_loop: tool_agent shows tool results through the chat template.*" + re.escape(reason)):
        make_ctx(ScriptedEngine(tok, {}), tokenizer=tok, agent={"default_loop": "tool_agent"})
    with pytest.raises(TemplateUnsupported, match="agent_name=react"):
        ChatRenderer(tok).observation_text([{"role": "tool", "content": "408"}])


@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_families_still_run_text_loops_exactly(family, tokenizers, make_ctx):
    tok = tokenizers[family]
    if family == "gemma2":  # its template refuses any system message, and react writes one: single turns only
        engine = ScriptedEngine(tok, {"r0": ["12 * 34 = 408\n#### 408"]})
        ctx = make_ctx(engine, tokenizer=tok, agent={"default_loop": "single_turn"})
        row = make_row(agent="single_turn")
        row = row.model_copy(update={"prompt": row.prompt[1:]})
        [t] = asyncio.run(RolloutRunner(ctx, LoopTable("single_turn")).run([("r0", row)]))
        assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
        assert t.response_ids == tok.encode("12 * 34 = 408\n#### 408", add_special_tokens=False) + [stop_tokens(tok).ids[0]] + ctx.renderer.separator_ids
        return
    engine = ScriptedEngine(tok, {"r0": ["Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\n", "Final Answer: #### 408\n"]})
    ctx = make_ctx(engine, tokenizer=tok, agent={"default_loop": "react"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("react")).run([("r0", make_row(agent="react"))]))
    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    assert t.tool_calls[0].result == "408"
    assert t.response_mask.count(1) == len(tok.encode("Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\nFinal Answer: #### 408\n", add_special_tokens=False))


# ---------------------------------------------------------------------- stops
def test_stop_tokens_are_end_of_turn_then_every_eos(tokenizers):
    expected = {
        "phi3.5": ["<|end|>", "<|endoftext|>", "<|assistant|>"],  # end-of-turn is not the tokenizer's eos
        "gemma2": ["<end_of_turn>", "<eos>"],
        "gemma3": ["<end_of_turn>", "<eos>"],
        "deepseek-r1-distill-qwen": ["<｜end▁of▁sentence｜>"],
        "gpt-oss": ["<|return|>", "<|call|>", "<|endoftext|>"],  # an answer ends with <|return|>, a call with <|call|>
        "glm-4.6": ["<|user|>", "<|observation|>", "<|endoftext|>"],  # the next message's role token ends a turn
        **{_family(c): v[4] for c, v in TOOL_FAMILIES.items()},
    }
    for family, tok in tokenizers.items():
        stops = stop_tokens(tok)
        assert stops.ids == tuple(tok.convert_tokens_to_ids(s) for s in expected[_family(family)]), family
        assert stops.end_of_turn == expected[_family(family)][0]
    phi = stop_tokens(tokenizers["phi3.5"])
    assert phi.sources[tokenizers["phi3.5"].convert_tokens_to_ids("<|assistant|>")] == ("generation_config.json eos_token_id",)


def test_scripted_engine_ends_a_text_with_the_family_end_of_turn_token_and_stops_there(tokenizers):
    from agentrl.engines.base import GenerateRequest, SamplingParams

    tok = tokenizers["phi3.5"]
    end = tok.convert_tokens_to_ids("<|end|>")
    engine = ScriptedEngine(tok, {"r": ["#### 408"]})
    request = GenerateRequest([1], SamplingParams(max_new_tokens=50, stop_token_ids=stop_tokens(tok).ids), session_id="r#0")
    result = asyncio.run(engine.generate(request))
    assert result.output_ids == tok.encode("#### 408", add_special_tokens=False) + [end]
    assert result.finish_reason.value == "stop" and result.matched_stop == end


# ---------------------------------------------------------------------- parsers
def test_auto_parser_follows_the_template(tokenizers):
    assert {f: detect_tool_parser(t) for f, t in tokenizers.items() if not f.endswith(REAL)} == {
        "qwen3": "hermes", "qwen2.5": "hermes", "llama3.1": "llama3_json", "llama3.2": "llama3_json", "mistral-nemo": "mistral",
        "phi3.5": "hermes", "phi4-mini": "phi4_mini", "gemma2": "hermes", "gemma3": "hermes",
        "deepseek-r1-distill-qwen": "deepseek_r1", "smollm2": "hermes", "smollm3": "hermes",
        "qwen3-coder": "qwen3_coder", "qwen3.5": "qwen3_coder", "glm-4.6": "glm45", "gpt-oss": "harmony",
    }
    assert {f: detect_tool_parser(tokenizers[f + REAL]) for f in REAL_VOCAB_FAMILIES} == {
        "qwen3": "hermes", "qwen2.5": "hermes", "llama3.1": "llama3_json", "llama3.2": "llama3_json", "mistral-nemo": "mistral",
    }


def test_an_explicit_tool_parser_overrides_auto(tokenizers, make_ctx):
    tok = tokenizers["qwen2.5"]
    ctx = make_ctx(ScriptedEngine(tok, {}), tokenizer=tok, agent={"tool_parser": "mistral"})
    assert type(ctx.parser).__name__ == "MistralToolParser"


def test_mistral_parser_keeps_valid_ids_and_replaces_others():
    turn = MistralToolParser().parse(
        'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "Ab3dE6gh9"}, {"name": "b", "arguments": "{\\"y\\": 2}", "id": "short"}]'
    )
    assert turn.content == "Sure."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    assert turn.calls[0].id == "Ab3dE6gh9" and turn.calls[1].id != "short" and re.fullmatch(r"[A-Za-z0-9]{9}", turn.calls[1].id)
    assert turn.calls[0].as_message_call()["id"] == "Ab3dE6gh9"
    assert turn.calls[0].result_message("ok") == {"role": "tool", "content": "ok", "tool_call_id": "Ab3dE6gh9"}


@pytest.mark.parametrize(
    "parser,text,detail",
    [
        (MistralToolParser(), '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
        (MistralToolParser(), '[TOOL_CALLS][{"arguments": {}}]', 'a tool call must be a JSON object {"name": ..., "arguments"'),
        (Llama3JsonToolParser(), '{"name": "calculator", "parameters": {"expression": "1"', "not valid JSON"),
        (Llama3JsonToolParser(), "<|python_tag|>import math", "code calls are not supported"),
        (Phi4MiniToolParser(), '<|tool_call|>[{"name": "a", "arguments": {}}]', "not closed with <|/tool_call|>"),
        (DeepSeekR1ToolParser(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{}", "must hold complete calls"),
    ],
)
def test_malformed_native_calls_are_kept_with_their_error(parser, text, detail):
    turn = parser.parse(text)
    assert turn.calls and all(c.error == "bad_json" for c in turn.calls)
    assert detail in turn.calls[0].detail


@pytest.mark.parametrize("parser", [HermesToolParser(), MistralToolParser(), Llama3JsonToolParser(), Phi4MiniToolParser(), DeepSeekR1ToolParser()])
def test_every_native_format_round_trips_two_calls(parser):
    calls = [("calculator", {"expression": "12 * 34"}), ("lookup", {"q": "é \"quoted\"", "n": [1, 2]})]
    turn = parser.parse(parser.format_calls(calls))
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [(n, a, None) for n, a in calls]


def test_llama3_plain_answers_are_not_calls():
    assert Llama3JsonToolParser().parse("The answer is {408}.").calls == []
    turn = Llama3JsonToolParser().parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2"}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "2"})]


def test_a_malformed_mistral_call_goes_through_the_policy(tokenizers, make_ctx):
    tok = tokenizers["mistral-nemo"]
    engine = ScriptedEngine(tok, {"r0": ['[TOOL_CALLS][{"name": "calculator", "arguments": {', "#### 408"]})
    ctx = make_ctx(engine, tokenizer=tok, agent={"malformed_call_policy": "end"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row())]))
    assert t.finish_reason == "malformed_tool_call" and t.tool_calls[0].error == "bad_json"


# ---------------------------------------------------------------------- check-template
CHECK_OK = [("qwen3", {}), ("qwen3", {"enable_thinking": False}), ("qwen2.5", {}), ("llama3.1", {}), ("llama3.2", {}),
            ("qwen3-coder", {}), ("qwen3.5", {}), ("qwen3.5", {"enable_thinking": False}), ("glm-4.6", {}),
            ("glm-4.6", {"enable_thinking": False}),
            ("mistral-nemo", {}), ("phi4-mini", {}), ("smollm2", {}), ("smollm3", {}), ("smollm3", {"enable_thinking": False})]
CHECK_OK += [(f + REAL, kw) for f, kw in CHECK_OK if f in REAL_VOCAB_FAMILIES]


@pytest.mark.parametrize("family,kwargs", CHECK_OK)
def test_check_template_passes_with_a_tool_round_trip(family, kwargs, tokenizers, family_dirs):
    report = check_template(tokenizers[family], chat_template_kwargs=kwargs, model_dir=family_dirs[family])
    assert report.ok and report.drift is None and report.tools == "ok" and report.round_trip == "ok", report.render()
    assert report.parser == detect_tool_parser(tokenizers[family])


@pytest.mark.parametrize("family,reason", list(REFUSED.items()))
def test_check_template_refuses_tools_with_the_reason_and_passes_without_them(family, reason, tokenizers, family_dirs, capsys):
    assert cli_main([str(family_dirs[family])]) == 2
    out = capsys.readouterr().out
    assert out.startswith("check-template: REFUSED") and reason in out
    assert cli_main([str(family_dirs[family]), "--no-tools"]) == 0


def test_check_template_reports_drift_with_both_sides_decoded(tokenizers, family_dirs, capsys):
    # a renderer that inserts a space into every observation drifts from the template
    from agentrl.agent import families

    original = ChatRenderer.observation_text
    try:
        ChatRenderer.observation_text = lambda self, messages, after_eos=True: " " + original(self, messages, after_eos=after_eos)
        assert families.cli_main([str(family_dirs["qwen2.5"])]) == 1
    finally:
        ChatRenderer.observation_text = original
    out = capsys.readouterr().out
    assert out.startswith("check-template: DRIFT")
    drift = re.search(r"token drift at position (\d+): ours \[.*?\] '(.*?)', reference \[.*?\] '(.*?)'", out)
    assert drift and drift.group(2).startswith(" ") and drift.group(3).startswith("\\n<|im_start|>user")


def test_check_template_json_output(family_dirs, capsys):
    assert cli_main([str(family_dirs["llama3.1"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parser"] == "llama3_json" and report["drift"] is None and report["end_of_turn"] == "<|eot_id|>"


def test_agentrl_check_template_is_a_command():
    from agentrl.cli import COMMANDS

    assert COMMANDS["check-template"][0] == "agentrl.agent.families:cli_main"


# ---------------------------------------------------------------------- the GSM8K tool variant, per family
GSM8K = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
}


@pytest.mark.parametrize("case", _with_real(TOOL_FAMILIES))
def test_gsm8k_tool_rollout_with_each_familys_native_calls(case, tokenizers, make_ctx):
    from agentrl.data.row import Row
    from data_prep.gsm8k import convert_record

    kwargs, parser, _, tool_text, stops, _ = TOOL_FAMILIES[_base(case)]
    tok = tokenizers[_key(case)]
    fmt = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser, "phi4_mini": Phi4MiniToolParser,
           "qwen3_coder": Qwen3CoderToolParser}[parser]
    calls = [("calculator", {"expression": "48 + 24"}), ("check_answer", {"answer": "72"})]
    script = [fmt.format_calls([calls[0]]), fmt.format_calls([calls[1]]), "Natalia sold 72 clips.\n#### 72"]
    row = Row.model_validate(convert_record(GSM8K, 0, "tool", "train"))
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, tools=("calculator", "check_answer"),
                   agent={"chat_template_kwargs": kwargs, "history": "as_sampled"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))

    assert t.finish_reason == "stop" and t.reward == 1.0, t.reward_info
    assert [(c.name, c.arguments, c.result) for c in t.tool_calls] == [
        ("calculator", {"expression": "48 + 24"}, "72"), ("check_answer", {"answer": "72"}, "correct"),
    ]
    stop_ids = tuple(tok.convert_tokens_to_ids(s) for s in stops)
    assert all(r.sampling.stop_token_ids == stop_ids for r in engine.requests)
    # exact: each sampled turn verbatim, each tool result as the template renders it
    tool_messages = [m for m in t.messages if m["role"] == "tool"]
    expected: list[int] = []
    for i, text in enumerate(script):
        expected += tok.encode(text, add_special_tokens=False) + [stop_ids[0]]
        if i < 2:
            rendered = tool_text.replace("408", ["72", "correct"][i])
            if parser == "mistral":
                rendered = rendered.replace("{id}", tool_messages[i]["tool_call_id"])
            expected += tok.encode(rendered, add_special_tokens=False)
    assert t.response_ids == expected + ctx.renderer.separator_ids
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    for turn, request in zip(t.turns[1::2], engine.requests[1:]):  # each request saw exactly the stream so far
        assert request.input_ids == t.prompt_ids + t.response_ids[: turn.end]


def test_check_template_passes_on_the_tiny_model(tiny_model_dir, capsys):
    assert cli_main([str(tiny_model_dir)]) == 0
    assert "tool parser: hermes" in capsys.readouterr().out


def test_stop_tokens_of_a_tokenizer_built_in_memory_read_no_generation_config(tokenizers, tmp_path, monkeypatch):
    tok = tokenizers["phi3.5"]
    monkeypatch.setattr(tok, "name_or_path", "")
    monkeypatch.chdir(tmp_path)  # a generation_config.json in the working directory is not this model's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert stop_tokens(tok).ids == tuple(tok.convert_tokens_to_ids(t) for t in ["<|end|>", "<|endoftext|>"])


USER_TURN = {  # the template's rendering of an appended user turn (an interaction's reply)
    "qwen3": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen2.5": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "llama3.1": "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama3.2": "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral-nemo": "[INST]{}[/INST]",  # without a system message (with one: test_a_moved_system_message_...)
    "phi3.5": "\n<|user|>\n{}<|end|>\n<|assistant|>\n",
    "phi4-mini": "<|user|>{}<|end|><|assistant|>",
    "gemma2": "\n<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
    "gemma3": "\n<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
    "deepseek-r1-distill-qwen": "<｜User｜>{}<｜Assistant｜><think>\n",
    "smollm2": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "smollm3": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-coder": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3.5": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "gpt-oss": "<|start|>user<|message|>{}<|end|><|start|>assistant",
    "glm-4.6": "\n{}<|assistant|>",  # after the <|user|> that ended the answer
}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_interaction_reply_is_the_templates_user_turn_with_no_placeholder(family, tokenizers, make_ctx):
    from agentrl_interactions.gsm8k import INCORRECT

    tok = tokenizers[family]
    engine = ScriptedEngine(tok, {"r0": ["#### 400", "#### 408"]})
    ctx = make_ctx(engine, tokenizer=tok, tools=(), agent={"default_loop": "single_turn", "history": "as_sampled"})
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    if family == "gemma2":  # refuses a system message
        row = row.model_copy(update={"prompt": row.prompt[1:]})
    if family == "mistral-nemo":  # its system message and tools block move to the last user turn: a test of its own
        row = row.model_copy(update={"prompt": row.prompt[1:], "extra_info": row.extra_info.model_copy(update={"tools_kwargs": {}})})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    assert t.finish_reason == "interaction_done", t.reward_info
    first, user, second = (t.response_ids[x.start : x.end] for x in t.turns)
    eot = stop_tokens(tok).ids[0]
    assert first == tok.encode("#### 400", add_special_tokens=False) + [eot]
    assert tok.decode(user) == USER_TURN[family].format(INCORRECT)
    assert user == tok.encode(USER_TURN[family].format(INCORRECT), add_special_tokens=False)
    assert second == tok.encode("#### 408", add_special_tokens=False) + [eot]
    assert "\x00" not in tok.decode(t.prompt_ids + t.response_ids)


@pytest.mark.parametrize("case", _with_real(["mistral-nemo"]))
def test_a_moved_system_message_is_where_the_template_puts_it_at_every_request(case, tokenizers, make_ctx):
    """Mistral-Nemo's template writes the system message into the last user turn: after an
    interaction's reply the second request has it before the reply, not before the question."""
    tok = tokenizers[_key(case)]
    script = ["#### 400", "#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, tools=(), agent={"default_loop": "single_turn"})
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}, tools_kwargs={})  # no tools block
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    assert t.finish_reason == "interaction_done", t.reward_info
    assert ctx.renderer.prompt_move.startswith("the template renders the system message of the first request elsewhere")
    assert_the_prompt_is_where_the_template_puts_it(t, engine, tok, None, {}, script)
    system, question = row.prompt[0].content, row.prompt[1].content
    first, second = (tok.decode(r.input_ids) for r in engine.requests)
    assert first == f"<s>[INST]{system}\n\n{question}[/INST]"
    assert second.startswith(f"<s>[INST]{question}[/INST]#### 400</s>[INST]{system}\n\n")
    assert [len(s.response_ids) for s in t.earlier_segments] == [len(tok.encode("#### 400", add_special_tokens=False)) + 1]
    assert t.metrics["template_segments"] == 1


@pytest.mark.parametrize("family,kwargs", CHECK_OK)
def test_check_template_reports_whether_the_prompt_stays_in_place(family, kwargs, tokenizers, family_dirs):
    report = check_template(tokenizers[family], chat_template_kwargs=kwargs, model_dir=family_dirs[family])
    lines = report.render().splitlines()
    if _family(family) == "mistral-nemo":
        assert report.ok  # usable: the loops split the conversation where the prompt moves
        assert "  prompt stays in place: no: the template renders the system message of the first request elsewhere once " \
               "a user turn follows (before the last user turn, or not at all); a request after such a turn starts a new " \
               "segment from the template's own rendering of the conversation" in lines
    else:
        assert "  prompt stays in place: yes" in lines and report.prompt_move is None

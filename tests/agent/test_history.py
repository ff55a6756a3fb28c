"""``agent.history``: every request of an ``as_template`` episode is the chat template's own
rendering of the messages so far (what a server applying the template gives the model at
inference), on the released templates of the families that rewrite their history (Qwen3 drops
earlier ``<think>`` blocks and, with thinking off, the empty one of its generation prompt;
DeepSeek-R1 drops the reasoning after its ``<think>`` generation prompt; Mistral-Nemo moves the
system prompt; Phi-4-mini renders no tool calls in history) and on append-only ones, where it is
the one stream ``as_sampled`` keeps. Each sampled turn stays in exactly one segment, verbatim."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agent_helpers import loop_with, make_row
from agent_helpers import run_rows as run
from family_fixtures import build_family_dir
from transformers import AutoTokenizer

from agentrl.agent.families import check_template, stop_tokens
from agentrl.agent.history import fresh_request, rewrites_history
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser, Phi4MiniToolParser
from agentrl_agent_programs.gsm8k_calculator import CALCULATOR

CALL = [("calculator", {"expression": "12 * 34"})]
THINK = "<think>\nguess\n</think>\n\n"
# family -> (template kwargs, the call text the model writes, think blocks in its turns,
#            earlier segments of the tool + retry episode under as_template)
FAMILIES = {
    "qwen3": ({}, HermesToolParser.format_calls(CALL), True, 1),  # the retry's user turn drops both <think> blocks
    "qwen3-no-thinking": ({"enable_thinking": False}, HermesToolParser.format_calls(CALL), False, 2),  # and the empty one
    "qwen2.5": ({}, HermesToolParser.format_calls(CALL), False, 0),  # append-only
    "llama3.1": ({}, Llama3JsonToolParser.format_calls(CALL), False, 0),  # append-only
    "mistral-nemo": ({}, MistralToolParser.format_calls(CALL), False, 2),  # the system prompt moves (twice)
    "phi4-mini": ({}, Phi4MiniToolParser.format_calls(CALL), False, 1),  # the call is not rendered in history
}


def _family(case: str) -> str:
    return case.removesuffix("-no-thinking")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("history-families")
    names = {_family(c) for c in FAMILIES} | {"deepseek-r1-distill-qwen"}
    return {name: AutoTokenizer.from_pretrained(build_family_dir(name, root / name)) for name in names}


def requests_as_rendered(t, engine, tok, tools, kwargs) -> list[list[int]]:
    """The template's rendering (with the generation prompt) of the messages before each
    assistant turn: what each engine request must be."""
    ends = [i for i, m in enumerate(t.messages) if m["role"] == "assistant"]
    assert len(ends) == len(engine.requests)
    return [tok.encode(tok.apply_chat_template(t.messages[:end], tools=tools, add_generation_prompt=True, tokenize=False,
                                               **kwargs), add_special_tokens=False) for end in ends]


def assert_each_sampled_turn_once_verbatim(t, tok, script) -> None:
    segments = [*t.earlier_segments, t]
    sampled = [s.response_ids[x.start : x.end] for s in segments for x in s.turns if x.role == "assistant"]
    eot = stop_tokens(tok).ids[0]
    assert sampled == [tok.encode(text, add_special_tokens=False) + [eot] for text in script]
    assert all(m == 1 for s in segments for x in s.turns if x.role == "assistant" for m in s.response_mask[x.start : x.end])
    assert sum(sum(s.response_mask) for s in segments) == sum(len(x) for x in sampled)  # nothing else is trained


def tool_and_retry(tok, kwargs, call_text, think, make_ctx, history):
    """A tool call, a wrong answer the GSM8K interaction calls incorrect, the right answer."""
    pre = THINK if think else ""
    script = [pre + ("Let me compute.\n" if "<tool_call>" in call_text else "") + call_text, pre + "#### 400", pre + "#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, agent={"chat_template_kwargs": kwargs, "history": history})
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    assert t.finish_reason == "interaction_done", t.reward_info
    assert [c.result for c in t.tool_calls] == ["408"]
    return t, engine, ctx, script


@pytest.mark.parametrize("case", list(FAMILIES))
def test_as_template_every_request_is_the_templates_rendering_of_the_messages_so_far(case, tokenizers, make_ctx):
    kwargs, call_text, think, segments = FAMILIES[case]
    tok = tokenizers[_family(case)]
    t, engine, ctx, script = tool_and_retry(tok, kwargs, call_text, think, make_ctx, "as_template")
    expected = requests_as_rendered(t, engine, tok, ctx.toolbox.schemas(["calculator"]), kwargs)
    assert [r.input_ids for r in engine.requests] == expected
    assert rewrites_history(ctx.renderer) is (segments > 0)
    assert len(t.earlier_segments) == segments == t.metrics.get("template_segments", 0.0)
    assert_each_sampled_turn_once_verbatim(t, tok, script)
    for seg in [*t.earlier_segments, t]:  # each segment starts from a request's fresh rendering
        assert seg.prompt_ids in expected
    for seg in [*t.earlier_segments, t]:  # the weight version of every sampled token (-1: not sampled)
        assert seg.token_versions == [0 if m else -1 for m in seg.response_mask]


def test_as_sampled_keeps_one_stream_with_the_earlier_reasoning_the_template_drops(tokenizers, make_ctx):
    """The issue's measurement on the released Qwen3 template: as_sampled's second answer is
    requested with the first <think> block still in context; as_template's is not."""
    tok = tokenizers["qwen3"]
    kwargs, call_text, think, _ = FAMILIES["qwen3"]
    sampled, engine_s, ctx, script = tool_and_retry(tok, kwargs, call_text, think, make_ctx, "as_sampled")
    template, engine_t, _, _ = tool_and_retry(tok, kwargs, call_text, think, make_ctx, "as_template")
    assert sampled.earlier_segments == [] and "template_segments" not in sampled.metrics
    assert_each_sampled_turn_once_verbatim(sampled, tok, script)
    last_sampled, last_template = (tok.decode(e.requests[-1].input_ids) for e in (engine_s, engine_t))
    assert last_sampled.count("<think>\nguess\n</think>") == 2
    assert "<think>" not in last_template and last_template.endswith("<|im_start|>assistant\n")
    # the two policies' last requests agree up to the first assistant turn the template rewrote
    assert engine_s.requests[1].input_ids == engine_t.requests[1].input_ids  # a tool result rewrites nothing


def test_deepseek_r1_reasoning_after_the_think_prompt_is_dropped_at_the_retry(tokenizers, make_ctx):
    tok = tokenizers["deepseek-r1-distill-qwen"]
    script = ["guess\n</think>\n\n#### 400", "again\n</think>\n\n#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok, tools=(), agent={"default_loop": "single_turn"})  # tool results are refused
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}, tools_kwargs={})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    assert t.finish_reason == "interaction_done", t.reward_info
    assert [r.input_ids for r in engine.requests] == requests_as_rendered(t, engine, tok, None, {})
    assert "guess" not in tok.decode(engine.requests[1].input_ids)
    assert len(t.earlier_segments) == 1
    assert_each_sampled_turn_once_verbatim(t, tok, script)


def test_a_loop_named_in_history_by_loop_keeps_its_own_policy(tokenizers, make_ctx):
    tok = tokenizers["qwen3"]
    engine = ScriptedEngine(tok, {"r0": [THINK + "#### 400", THINK + "#### 408"]})
    ctx = make_ctx(engine, tokenizer=tok, tools=(), agent={"history": "as_template", "history_by_loop": {"tool_agent": "as_sampled"}})
    assert (ctx.history, ctx.history_for("tool_agent"), ctx.history_for("react")) == ("as_template", "as_sampled", "as_template")
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}, tools_kwargs={})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    assert t.earlier_segments == [] and tok.decode(engine.requests[1].input_ids).count("<think>") == 1


def test_fresh_request_compares_text_so_a_sampled_tokenization_the_tokenizer_would_not_choose_is_kept(tokenizers, make_ctx):
    tok = tokenizers["qwen3"]
    ctx = make_ctx(ScriptedEngine(tok, {}), tokenizer=tok, tools=())
    r = ctx.renderer
    messages = [{"role": "user", "content": "q"}]
    prompt = r.prompt_ids(messages)
    answer = "#### 408"
    odd = [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(tok.encode(answer, add_special_tokens=False))]
    split = [i for piece in answer for i in tok.encode(piece, add_special_tokens=False)]  # one token per character
    assert split != tok.encode(answer, add_special_tokens=False) and odd
    more = [{"role": "assistant", "content": answer}, {"role": "tool", "content": "t"}]
    text = r.observation_text(more[1:])
    assert fresh_request(r, "as_template", prompt + split + [r.eos_id], text, messages + more, None) is None
    assert fresh_request(r, "as_sampled", prompt, text, messages + more, None) is None
    rewritten = fresh_request(r, "as_template", prompt + tok.encode("other", add_special_tokens=False) + [r.eos_id], text,
                              messages + more, None)
    assert rewritten == r.prompt_ids(messages + more)


def test_the_endpoint_renders_each_request_as_the_template_does(tokenizers, make_ctx):
    """An agent program that echoes its history through the OpenAI endpoint on the Qwen3
    template: the retry's request drops the earlier <think> block, as the template does."""
    tok = tokenizers["qwen3"]
    script = [THINK + "#### 400", THINK + "#### 408"]
    engine = ScriptedEngine(tok, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tok)
    sent = []

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = list(task.messages)
        for retry in ("Incorrect. Try again.", None):
            reply = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR])
            sent.append(list(messages))
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if retry:
                messages.append({"role": "user", "content": retry})
        return messages[-1]["content"]

    (t,) = run(loop_with(program), ctx, [("r0", make_row(agent="openai_agent"))])
    rendered = [tok.encode(tok.apply_chat_template(m, tools=[CALCULATOR], add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False) for m in sent]
    assert [r.input_ids for r in engine.requests] == rendered
    assert "<think>" not in tok.decode(engine.requests[1].input_ids)
    assert t.metrics["segment_splits"] == 1 and len(t.earlier_segments) == 1
    assert_each_sampled_turn_once_verbatim(t, tok, script)


def test_check_template_says_where_a_family_rewrites_its_history(tokenizers):
    qwen3 = check_template(tokenizers["qwen3"]).render()
    assert "  history: rewritten by the template" in qwen3 and "<think>" in qwen3
    assert "agent.history=as_template starts a new segment" in qwen3
    assert "  history: append-only" in check_template(tokenizers["qwen2.5"]).render()


def test_replay_rerun_of_a_segmented_trajectory_matches_segment_by_segment(tokenizers, make_ctx, tmp_path):
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.replay.rerun import rerun_trajectories

    tok = tokenizers["qwen3"]
    kwargs, call_text, think, _ = FAMILIES["qwen3"]
    t, _, _, _ = tool_and_retry(tok, kwargs, call_text, think, make_ctx, "as_template")
    store = RolloutStore(tmp_path)
    store.write_step(0, [t], rows=[("r0", make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}))])
    records = list(store.iter_stored())
    assert len(records[0].trajectory.earlier_segments) == 1  # stored with its segments
    [same] = asyncio.run(rerun_trajectories(records, make_ctx(None, tokenizer=tok), LoopTable("tool_agent"), decode=tok.decode))
    assert same.differences == [] and len(same.rerun.earlier_segments) == 1
    # re-run as one stream: the difference is named, and the stream differs where the template rewrote
    ctx = make_ctx(None, tokenizer=tok, agent={"history": "as_sampled"})
    [other] = asyncio.run(rerun_trajectories(records, ctx, LoopTable("tool_agent"), decode=tok.decode))
    assert [d.kind for d in other.differences][:1] == ["segments"]
    assert "2 segments stored, 1 in the re-run" in other.differences[0].detail

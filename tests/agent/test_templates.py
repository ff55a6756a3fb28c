"""Token exactness per chat template: the drift test, non-append-only templates, the fast paths.

For every template shipped or fixtured, each loop's final stream (prompt + response) must equal
``tokenizer.apply_chat_template(final messages)`` token for token - the reference is transformers'
own rendering, not the renderer under test.
"""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import CALL_12x34, make_row
from chat_templates import DROPS_THINKING, PLAIN, QWEN25, TRIMS_TOOL_OUTPUT
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from agentrl.agent.render import ChatRenderer
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl_interactions.gsm8k import INCORRECT

CALL_408_PLUS_1 = CALL_12x34.replace("12 * 34", "408 + 1")
RETRY = {"name": "gsm8k", "ground_truth": "408"}

# (loop, script, row extra_info, expected finish reason) - every path a loop can take to an end
EPISODES = {
    "tool_agent": ("tool_agent", ["Let me compute.\n" + CALL_12x34 + "\n" + CALL_408_PLUS_1, "#### 409"], {}, "stop"),
    "tool_agent_retry": ("tool_agent", [CALL_12x34, "#### 400", "#### 408"], {"interaction_kwargs": RETRY}, "interaction_done"),
    "single_turn": ("single_turn", ["The answer is\n#### 408"], {}, "stop"),
    "react": ("react", ["Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\n", "Final Answer: #### 408\n"], {}, "stop"),
    "react_json_input": (
        "react", ['Action: calculator\nAction Input: {"expression": "12 * 34"}\n', "Thought: done\nFinal Answer: 408\n"], {}, "stop"
    ),
}
TEMPLATES = {
    "tiny": (None, ["tool_agent", "tool_agent_retry", "single_turn", "react", "react_json_input"]),
    "qwen2.5": (QWEN25, ["tool_agent", "tool_agent_retry", "single_turn", "react", "react_json_input"]),
    # a plain template renders no tool calls: the text loops only
    "plain": (PLAIN, ["single_turn", "react", "react_json_input"]),
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    out = {}
    for name, (template, _) in TEMPLATES.items():
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        if template is not None:
            tok.chat_template = template
        out[name] = tok
    return out


def rollout(make_ctx, tokenizer, script, row, **ctx_kwargs):
    engine = ScriptedEngine(tokenizer, {"r0": script})
    ctx = make_ctx(engine, tokenizer=tokenizer, **ctx_kwargs)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)]))
    return t, ctx, engine


def reference_ids(tokenizer, messages, tools):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)


@pytest.mark.parametrize(
    "template,episode", [(t, e) for t, (_, episodes) in TEMPLATES.items() for e in episodes]
)
def test_final_stream_equals_the_templates_rendering_of_the_final_messages(template, episode, tokenizers, make_ctx):
    tok = tokenizers[template]
    loop, script, extra, finish = EPISODES[episode]
    t, ctx, _ = rollout(make_ctx, tok, script, make_row(agent=loop, **extra))
    assert t.finish_reason == finish, t.reward_info
    assert ctx.renderer.append_only
    tools = ctx.toolbox.schemas(["calculator"]) if loop == "tool_agent" else None
    # through the last answer: an interaction's final reply ("correct") ends the messages, not the stream
    held = t.messages[:-1] if t.finish_reason == "interaction_done" else t.messages
    assert t.prompt_ids + t.response_ids == reference_ids(tok, held, tools)
    # the separators the engine never samples (after each end-of-turn token) are masked
    eos = ctx.renderer.eos_id
    for i, token in enumerate(t.response_ids):
        if token == eos and i + 1 < len(t.response_ids):
            assert t.response_mask[i + 1] == 0


def test_qwen25_template_puts_its_default_system_prompt_and_tools_in_the_prompt(tokenizers, make_ctx):
    tok = tokenizers["qwen2.5"]
    row = make_row(agent="tool_agent")
    row.prompt = row.prompt[1:]  # no system message: the template supplies Qwen's
    t, ctx, _ = rollout(make_ctx, tok, [CALL_12x34, "#### 408"], row)
    prompt = tok.decode(t.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(t.response_ids[t.turns[1].start : t.turns[1].end]) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.prompt_ids + t.response_ids == reference_ids(tok, t.messages, ctx.toolbox.schemas(["calculator"]))


def test_plain_template_needs_no_markup_tokens(tokenizers, make_ctx):
    tok = tokenizers["plain"]
    t, ctx, _ = rollout(make_ctx, tok, EPISODES["react"][1], make_row(agent="react"))
    assert tok.decode(t.response_ids) == (
        "Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\nObservation: 408\nFinal Answer: #### 408\n<|im_end|>\n"
    )
    assert "<|im_start|>" not in tok.decode(t.prompt_ids) and tok.decode(t.prompt_ids).endswith("User: What is 12 * 34?\nAssistant:\n")
    assert ctx.renderer.separator == "\n" and ctx.renderer.eos_token == "<|im_end|>"


def test_template_that_drops_earlier_thinking_is_detected_and_the_stream_keeps_what_the_model_saw(tiny_model_dir, make_ctx):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = DROPS_THINKING
    row = make_row(interaction_kwargs=RETRY)
    # agent.history=as_sampled: one stream (as_template starts a segment at the retry: tests/agent/test_history.py)
    t, ctx, engine = rollout(make_ctx, tok, ["<think>guess</think>#### 400", "<think>compute</think>#### 408"], row,
                             agent={"history": "as_sampled"})
    assert not ctx.renderer.append_only
    assert t.finish_reason == "interaction_done"
    first, user, second = (t.response_ids[x.start : x.end] for x in t.turns)
    # the model's real context: its first answer with the thinking it wrote, then the exact delta
    assert tok.decode(first) == "<think>guess</think>#### 400<|im_end|>"
    assert tok.decode(user) == f"\n<|im_start|>user\n{INCORRECT}<|im_end|>\n<|im_start|>assistant\n"
    assert engine.requests[1].input_ids == t.prompt_ids + first + user
    # a fresh rendering of the final messages drops the first <think> block: it is not the stream
    rendered = reference_ids(tok, t.messages, None)
    assert "<think>guess</think>" not in tok.decode(rendered)
    assert t.prompt_ids + t.response_ids != rendered
    assert t.prompt_ids + t.response_ids == t.prompt_ids + first + user + second + ctx.renderer.separator_ids


@pytest.mark.parametrize("template", ["tiny", "qwen2.5", "plain"])
def test_shipped_and_fixture_templates_are_append_only(template, tokenizers):
    assert ChatRenderer(tokenizers[template]).append_only


def test_template_that_trims_tool_output_is_rendered_in_full_not_from_the_shape_cache(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TRIMS_TOOL_OUTPUT
    renderer = ChatRenderer(tok)
    text = renderer.observation_text([{"role": "tool", "content": "  408 \n"}])
    assert text == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_end_of_turn_token_comes_from_the_template_not_the_tokenizers_eos(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.eos_token = "<|endoftext|>"  # as in Qwen2.5 base checkpoints
    renderer = ChatRenderer(tok)
    assert renderer.eos_token == "<|im_end|>" and renderer.eos_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_template_without_an_end_of_turn_token_is_refused_with_the_reason(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"ends an assistant message with '\\n', which does not start with an added token"):
        ChatRenderer(tok)


# ---------------------------------------------------------------------- fast paths = reference
PIECES = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "\n", "\n\n", " ", ".", ".\n",
     "12", "3 * 4", "é", "word", " word", "{\"a\": 1}", "\t", "<", "|", "im_end", "#### "]
)
TEXTS = st.one_of(st.text(max_size=80), st.lists(PIECES, max_size=20).map("".join))


@settings(max_examples=150, deadline=None)
@given(TEXTS)
def test_cached_piecewise_encoding_equals_the_tokenizers_encoding(tiny_tokenizer, text):
    renderer = _renderer(tiny_tokenizer)
    assert renderer.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert renderer.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)  # from the cache
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert renderer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(contents=st.lists(TEXTS, min_size=1, max_size=3), roles=st.lists(st.sampled_from(["tool", "user"]), min_size=3, max_size=3))
def test_cached_delta_equals_the_templates_rendering_after_an_assistant_turn(tiny_tokenizer, contents, roles):
    renderer = _renderer(tiny_tokenizer)
    messages = [{"role": role, "content": c} for role, c in zip(roles, contents)]
    before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    full = tiny_tokenizer.apply_chat_template(before + messages, tokenize=False, add_generation_prompt=True)
    prefix = tiny_tokenizer.apply_chat_template(before, tokenize=False)
    assert full.startswith(prefix)
    # the delta follows the sampled "<|im_end|>": the template's "\n" after it comes first
    assert prefix.endswith("<|im_end|>" + renderer.separator)
    assert renderer.observation_text(messages) == renderer.separator + full[len(prefix) :]


_RENDERERS: dict[int, ChatRenderer] = {}


def _renderer(tokenizer) -> ChatRenderer:
    # one renderer across hypothesis examples, so the caches are exercised
    if id(tokenizer) not in _RENDERERS:
        _RENDERERS[id(tokenizer)] = ChatRenderer(tokenizer)
    return _RENDERERS[id(tokenizer)]


def test_an_observation_after_a_turn_that_did_not_end_on_eos_has_no_separator(tiny_tokenizer):
    """The separator the template writes after <|im_end|> follows only a turn that sampled
    <|im_end|>; after a turn cut short (stop string, length) the observation starts bare."""
    renderer = ChatRenderer(tiny_tokenizer)
    tool = [{"role": "tool", "content": "408"}]
    after_eos = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert renderer.separator == "\n"
    assert renderer.observation_text(tool) == after_eos
    assert renderer.observation_text(tool, after_eos=False) == after_eos[1:]

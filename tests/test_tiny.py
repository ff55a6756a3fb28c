"""The tiny model builder: tokenizer round trip, chat template, assistant mask, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from agentrl.tiny import SPECIAL_TOKENS, TOOL_TOKENS, build_tiny_model, tiny_model_dir

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "#### 408"},
]
EXPECTED = (
    "<|im_start|>system\nUse the calculator.\n# Tools\n<tools>\n"
    + json.dumps(CALCULATOR)
    + "\n</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n#### 408<|im_end|>\n"
)
TEXTS = [
    "4821 * 37 = 178377",
    "Hello world, it's 3.14!\n\n  x",
    "<|im_start|>user\nWhat's 12+34?<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call>",
    "café naïve ünïcödé 😀",
    "  leading\ttabs\r\n",
]


def test_ids_are_identical_after_reload_with_auto_classes(tiny_model_dir, tiny_tokenizer):
    trained = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert ids == trained.encode(text, add_special_tokens=False).ids
        assert tiny_tokenizer.decode(ids) == text


def test_each_special_and_tool_token_is_one_id(tiny_tokenizer):
    ids = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS + TOOL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(ids)
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"


def test_digits_are_one_token_each(tiny_tokenizer):
    pieces = [tiny_tokenizer.decode([i]) for i in tiny_tokenizer.encode("178377", add_special_tokens=False)]
    assert pieces == list("178377")


def test_chat_template_renders_tools_calls_and_responses_exactly(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=[CALCULATOR], tokenize=False)
    assert text == EXPECTED


def test_consecutive_tool_messages_share_one_user_turn(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": {}}},
            {"type": "function", "function": {"name": "b", "arguments": {}}},
        ]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_is_append_only_at_assistant_boundaries(tiny_tokenizer):
    full = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=[CALCULATOR], tokenize=False)
    for k in range(1, len(CONVERSATION)):
        if CONVERSATION[k]["role"] == "assistant":
            prefix = tiny_tokenizer.apply_chat_template(
                CONVERSATION[:k], tools=[CALCULATOR], tokenize=False, add_generation_prompt=True
            )
            assert full.startswith(prefix)


def test_assistant_mask_covers_exactly_the_assistant_content(tiny_tokenizer):
    out = tiny_tokenizer.apply_chat_template(
        CONVERSATION, tools=[CALCULATOR], return_assistant_tokens_mask=True, return_dict=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids == tiny_tokenizer.encode(EXPECTED, add_special_tokens=False)
    trained = tiny_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == (
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}\n</tool_call><|im_end|>"
        "#### 408<|im_end|>"
    )


@pytest.mark.parametrize("size,low,high", [("1m", 0.7e6, 1.3e6), ("5m", 5e6, 8e6), ("18m", 16e6, 20e6)])
def test_model_sizes_are_in_their_range(tmp_path, size, low, high):
    directory = build_tiny_model(tmp_path / size, size=size)
    model = AutoModelForCausalLM.from_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    assert low <= n <= high, n
    assert model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32


def test_model_runs_forward_and_generation_stops_at_im_end(tiny_model_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tiny_tokenizer))
    assert model.generation_config.eos_token_id == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_same_seed_builds_the_same_tokenizer_and_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    wa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cached_builder_reuses_its_directory(tmp_path):
    first = tiny_model_dir("1m", seed=1, cache_root=tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("1m", seed=1, cache_root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directories left


def test_unknown_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model size '2m'"):
        build_tiny_model(tmp_path, size="2m")


def test_model_dir_arg_names_the_tiny_model_like_model_equals_tiny(tmp_path, monkeypatch):
    """``tiny`` on any command's model argument is the cached tiny model ``model=tiny`` uses."""
    from agentrl.tiny import model_dir_arg

    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    built = model_dir_arg("tiny")
    assert built == tiny_model_dir("1m") and (built / "config.json").is_file()
    assert built.parent == tmp_path / "cache" / "tiny"
    assert model_dir_arg("tiny:1m") == built
    with pytest.raises(ValueError, match=r"tiny:2m: the tiny model comes in sizes 1m, 5m, 18m, 100m, not '2m'"):
        model_dir_arg("tiny:2m")
    assert model_dir_arg("models/qwen") == __import__("pathlib").Path("models/qwen")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a real directory named tiny is the user's, not ours
    assert model_dir_arg("tiny") == __import__("pathlib").Path("tiny")


def test_check_template_and_serve_take_tiny_as_their_model(tmp_path, monkeypatch):
    """The argparse commands reach the tiny model too: check-template passes on it, serve names the sizes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "AGENTRL_CACHE": str(tmp_path / "cache")}
    cli = [sys.executable, "-m", "agentrl.cli"]
    done = subprocess.run([*cli, "check-template", "tiny", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    # the stop id comes from the tiny model directory's generation_config.json, so that directory was used
    assert report["stop_tokens"] == {
        "2": "chat template end-of-turn '<|im_end|>'; tokenizer eos '<|im_end|>'; generation_config.json eos_token_id"
    }
    assert (tiny_model_dir("1m", cache_root=tmp_path / "cache" / "tiny") / "config.json").is_file()  # built there for it
    bad = subprocess.run([*cli, "serve", "--model", "tiny:9m"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "--model tiny:9m: the tiny model comes in sizes 1m, 5m, 18m, 100m, not '9m'" in bad.stderr

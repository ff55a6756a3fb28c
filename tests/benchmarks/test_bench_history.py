"""agentrl bench history: its episodes are the rewriting episodes it says, and its counts add up.

Qwen3's template drops earlier reasoning at each retry: under as_template an episode of T turns
is T segments (rows), as_sampled one row; the per-segment baseline computes every row's tokens,
the prefix trees fewer, and every mode trains the same sampled tokens."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.tiny import with_chat_template
from agentrl_benchmarks.history import MODES, REPO_TEMPLATE, episodes, measure


def test_episodes_retry_until_the_last_turn_and_as_template_starts_a_segment_at_each_retry(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(with_chat_template(tiny_model_dir, REPO_TEMPLATE, cache_root=tmp_path))
    sampled = episodes(tok, 3, "as_sampled", rows=2, reasoning_words=4)
    template = episodes(tok, 3, "as_template", rows=2, reasoning_words=4)
    assert [len(t.earlier_segments) for t in sampled] == [0, 0] and [len(t.earlier_segments) for t in template] == [2, 2]
    assert all(t.reward == 1.0 and t.metrics["user_turns"] == 2 for t in sampled + template)
    last = tok.decode(template[0].prompt_ids)
    assert "<think>" not in last and last.count("#### 50") == 2  # the earlier answers, without their reasoning
    assert tok.decode(sampled[0].prompt_ids + sampled[0].response_ids).count("<think>") == 3


def test_measure_counts_rows_tokens_and_times_every_mode(tiny_model_dir, tmp_path):
    path = with_chat_template(tiny_model_dir, REPO_TEMPLATE, cache_root=tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    r = measure(model, tok, 3, rows=2, repeats=1, reasoning_words=4)
    assert (r["as_sampled"]["rows"], r["as_template"]["rows"], r["as_template_rows"]["rows"]) == (2, 6, 6)
    assert len({r[m]["trained"] for m in MODES}) == 1  # every sampled token trained once, whatever the layout
    rows = r["as_template_rows"]
    assert rows["computed"] == rows["row_tokens"] == r["as_template"]["row_tokens"]  # a forward per row
    assert r["as_template"]["computed"] < rows["computed"]  # the trees compute the shared prefixes once
    for m in MODES:
        assert r[m]["step_s"] > 0 and r[m]["saved_mb"] > 0
        assert r[m]["computed_vs_sampled"] == round(r[m]["computed"] / r["as_sampled"]["computed"], 3)

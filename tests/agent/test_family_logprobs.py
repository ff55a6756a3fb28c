"""Engine and trainer agree to 1e-5 on the families' architectures and released vocabularies.

``tests/trainer/test_logprob_agreement.py`` holds the engine's sampled logprobs to the trainer's
on the tiny Qwen2. Here the same check runs on each family whose released vocabulary we can build
(``real_vocab.py``), with that family's architecture as transformers defines it: Qwen3 (per-head
q/k norms, explicit head width), Llama 3.1 (``llama3`` rotary scaling, untied head) and
Mistral-Nemo (a head width that is not hidden / heads; no fast path, so the module paths run).
The prompts are the family's chat template rendering a question with a tool list, tokenized by
the released vocabulary: ids above 128,000, the family's special tokens and a few hundred
positions. Each model is tiny but initialised far from uniform (N(0, 0.1) matrices), so a wrong
position, a skipped q/k norm or a mis-scaled rotary frequency moves a logprob by far more than
the tolerance; ``test_the_family_specific_parts_move_the_logprobs`` shows that it does.
"""

from __future__ import annotations

import pytest
import torch
from family_fixtures import build_family_dir
from logprob_checks import as_batch, engine_samples, mismatch, sharpen, trainer_logprobs

import agentrl.engines._packed as engine_packed
import agentrl.trainer.packed as trainer_packed

MAX_ABS = 1e-5
MAX_MEAN = 3e-6
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "What is 12 * 34?",
    "Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?",
]


def _config(family: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "qwen3":  # head_dim 32 x 4 heads = 128 != hidden 64, as Qwen3's head_dim is set explicitly
        return Qwen3Config(**common, head_dim=32, rope_theta=1_000_000.0)
    if family == "llama3.1":
        return LlamaConfig(**common, rope_theta=500_000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256})  # short, so the scaling bends frequencies used here
    if family == "mistral-nemo":
        return MistralConfig(**common, head_dim=32, rope_theta=1_000_000.0, sliding_window=None)
    raise AssertionError(family)


FAMILIES = ["qwen3", "llama3.1", "mistral-nemo"]
FAST_PATH = {"qwen3": True, "llama3.1": True, "mistral-nemo": False}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    """(family, model dir, model, prompts): the family's tokenizer and chat template, a tiny model of
    its architecture with sharp random weights, and three rendered prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = request.param
    out = build_family_dir(family, tmp_path_factory.mktemp(family), real_vocab=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, len(tokenizer)), dtype=torch.float32)
    sharpen(model)
    model.save_pretrained(out)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=TOOLS, add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    return family, out, model.eval(), prompts


def _samples(model_dir, prompts, temperature: float, *, module_path: bool, monkeypatch):
    return engine_samples(model_dir, prompts, temperature, max_new_tokens=10, module_path=module_path, monkeypatch=monkeypatch)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trainer_logprobs_match_the_engine_within_1e_5_on_each_family(family_model, temperature, monkeypatch):
    family, model_dir, model, prompts = family_model
    assert engine_packed.fast_decoder_supported(model.base_model) == FAST_PATH[family]
    assert max(max(p) for p in prompts) > 50_000 and min(len(p) for p in prompts) > 50  # real ids, long prompts
    engine_paths = ["packed", "module"] if FAST_PATH[family] else ["module"]
    for engine_path in engine_paths:
        results = _samples(model_dir, prompts, temperature, module_path=engine_path == "module", monkeypatch=monkeypatch)
        batch = as_batch(prompts, results)
        assert int(batch.response_mask.sum()) == sum(len(r.output_ids) for r in results) > 20
        mean_logprob = float((batch.engine_logprobs * batch.response_mask).sum() / batch.response_mask.sum())
        assert mean_logprob < -0.5  # far from one-hot, and (with ~10^5 ids) far from uniform below
        for trainer_path in (["packed", "module"] if FAST_PATH[family] else ["module"]):
            assert trainer_packed.packed_supported(model, batch) == FAST_PATH[family]
            got = trainer_logprobs(model, batch, temperature, module_path=trainer_path == "module", monkeypatch=monkeypatch)
            worst, mean = mismatch(got, batch)
            assert worst < MAX_ABS and mean < MAX_MEAN, (family, engine_path, trainer_path, worst, mean)


def test_the_family_specific_parts_move_the_logprobs(family_model, monkeypatch):
    """The agreement above could not hold if one path dropped what sets the family apart."""
    family, model_dir, model, prompts = family_model
    batch = as_batch(prompts, _samples(model_dir, prompts, 1.0, module_path=not FAST_PATH[family], monkeypatch=monkeypatch))
    attn = model.model.layers[0].self_attn
    if family == "qwen3":  # per-head q/k norms set to identity
        parts = [attn.q_norm.weight, attn.k_norm.weight]
        changes = [torch.ones_like(p) for p in parts]
    elif family == "llama3.1":  # the rotary frequencies without the llama3 scaling
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        plain = LlamaConfig(**{**model.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}})
        parts = [model.model.rotary_emb.inv_freq]
        changes = [LlamaRotaryEmbedding(plain).inv_freq]
        assert not torch.allclose(parts[0], changes[0])
    else:  # Mistral-Nemo: the first layer's attention output off
        parts = [attn.o_proj.weight]
        changes = [torch.zeros_like(parts[0])]
    saved = [p.detach().clone() for p in parts]
    with torch.no_grad():
        for p, c in zip(parts, changes):
            p.copy_(c)
    try:
        for path in (["packed", "module"] if FAST_PATH[family] else ["module"]):
            changed = trainer_logprobs(model, batch, 1.0, module_path=path == "module", monkeypatch=monkeypatch)
            assert mismatch(changed, batch)[1] > 1000 * MAX_MEAN, (family, path)
    finally:
        with torch.no_grad():
            for p, s in zip(parts, saved):
                p.copy_(s)

"""The trainer scores the distribution the engine sampled from, at any rollout temperature.

Real built-in engine (continuous batching, padding-free ragged forward) against the trainer's
forward over left-padded prompts of different lengths, fp32 on CPU, both on their fast paths
(the engine's packed decoder, the trainer's packed segments) and on their module paths (the
model's own ``forward``). The model is the tiny Qwen2 re-initialised with weights large enough
that the distribution is far from uniform, every layer changes it and so does each token's
position: with the default 0.02 initialisation a skipped layer or a wrong position moves a
logprob by less than 1e-3, so a loose tolerance would let either bug through.

Measured agreement on this model (fp32, CPU): max 6.2e-6, mean 1.8e-6 over all paths and
temperatures; the tolerances are 1e-5 and 3e-6.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from logprob_checks import as_batch, engine_samples, mismatch, sharpen, trainer_logprobs

from agentrl.trainer.prefix import response_logprobs

PROMPTS = [[5, 17, 99, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13]]
MAX_ABS = 1e-5
MAX_MEAN = 3e-6


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with N(0, 0.1) matrices, norms near 1 and small random biases."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharpen(model)
    out = tmp_path_factory.mktemp("sharp-tiny")
    model.save_pretrained(out)
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name not in {"config.json", "model.safetensors", "generation_config.json"}:
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def sharp_model(sharp_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32).eval()


def samples(model_dir, temperature: float, **kwargs):
    return engine_samples(model_dir, PROMPTS, temperature, max_new_tokens=12, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("engine_path", ["packed", "module", "static"])  # static: the decode-graph layout, run eagerly
def test_trainer_logprobs_match_the_engine_within_1e_5(sharp_model_dir, sharp_model, temperature, engine_path, monkeypatch):
    results = samples(sharp_model_dir, temperature, module_path=engine_path == "module", monkeypatch=monkeypatch,
                      decode_graphs=engine_path == "static")
    batch = as_batch(PROMPTS, results)
    assert int(batch.response_mask.sum()) == sum(len(r.output_ids) for r in results) > 20
    # the sampled tokens are far from uniform: a tolerance of 1e-5 is a real constraint here
    mean_logprob = float((batch.engine_logprobs * batch.response_mask).sum() / batch.response_mask.sum())
    assert -6.5 < mean_logprob < -0.5
    for trainer_path in ("packed", "module"):
        got = trainer_logprobs(sharp_model, batch, temperature, module_path=trainer_path == "module", monkeypatch=monkeypatch)
        worst, mean = mismatch(got, batch)
        assert worst < MAX_ABS and mean < MAX_MEAN, (trainer_path, worst, mean)


def test_every_layer_and_each_position_move_the_logprobs_far_beyond_the_tolerance(sharp_model_dir, sharp_model, monkeypatch):
    """The agreement above could not hold with a skipped layer or a position off by one."""
    batch = as_batch(PROMPTS, samples(sharp_model_dir, 1.0))
    for layer in sharp_model.model.layers:
        # the layer adds nothing to the residual stream: it is skipped on both paths
        outputs = [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
        saved = [w.detach().clone() for w in outputs]
        with torch.no_grad():
            for w in outputs:
                w.zero_()
        try:
            for path in ("packed", "module"):
                skipped = trainer_logprobs(sharp_model, batch, 1.0, module_path=path == "module", monkeypatch=monkeypatch)
                assert mismatch(skipped, batch)[1] > 1000 * MAX_MEAN, path
        finally:
            with torch.no_grad():
                for w, s in zip(outputs, saved):
                    w.copy_(s)
    # every response token one position further from its prompt
    P, mask = batch.prompt_length, batch.response_mask
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    for shift in (0, 1):
        moved = positions.clone()
        moved[:, P:] += shift
        with torch.no_grad():
            logits = sharp_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=moved).logits
        logprobs = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, batch.input_ids[:, P:, None])[..., 0] * mask
        worst, mean = mismatch(logprobs, batch)
        if shift == 0:
            assert worst < MAX_ABS and mean < MAX_MEAN
        else:
            assert mean > 1000 * MAX_MEAN


def test_ignoring_the_temperature_would_be_caught(sharp_model_dir, sharp_model):
    """Scoring T = 0.6 samples at T = 1 is far off."""
    batch = as_batch(PROMPTS, samples(sharp_model_dir, 0.6))
    with torch.no_grad():
        untempered, _ = response_logprobs(sharp_model, batch)
    assert mismatch(untempered, batch)[1] > 1e-2

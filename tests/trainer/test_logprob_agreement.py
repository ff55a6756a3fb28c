"""The trainer scores the distribution the engine sampled from, at any rollout temperature.

Real tiny model, real built-in engine (continuous batching, padded-free ragged forward) against
the trainer's padded batch forward (left-padded prompts of different lengths): fp32 on CPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.workers import response_logprobs

PROMPTS = [[5, 17, 99, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13]]


def engine_samples(model_dir, temperature: float):
    async def run():
        async with BuiltinEngine(model_dir, max_batch_size=8) as engine:
            requests = [
                GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=temperature, seed=i)) for i, p in enumerate(PROMPTS)
            ]
            return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(run())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_trainer_logprobs_match_the_engine_within_1e_3(tiny_model_dir, temperature):
    from transformers import AutoModelForCausalLM

    results = engine_samples(tiny_model_dir, temperature)
    batch = collate_sequences(
        PROMPTS, [r.output_ids for r in results], [[1] * len(r.output_ids) for r in results],
        pad_token_id=0, logprobs=[r.logprobs for r in results],
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer, _ = response_logprobs(model, batch, temperature=temperature)
    mask = batch.response_mask
    delta = (trainer - batch.engine_logprobs).abs() * mask
    assert mask.sum() == sum(len(r.output_ids) for r in results)
    assert float(delta.sum() / mask.sum()) < 1e-3
    assert float(delta.max()) < 1e-2


def test_ignoring_the_temperature_would_be_caught(tiny_model_dir):
    """The check above can fail: scoring T = 0.6 samples at T = 1 is far off."""
    from transformers import AutoModelForCausalLM

    results = engine_samples(tiny_model_dir, 0.6)
    batch = collate_sequences(
        PROMPTS, [r.output_ids for r in results], [[1] * len(r.output_ids) for r in results],
        pad_token_id=0, logprobs=[r.logprobs for r in results],
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        untempered, _ = response_logprobs(model, batch)
    mask = batch.response_mask
    assert float(((untempered - batch.engine_logprobs).abs() * mask).sum() / mask.sum()) > 1e-2

"""Partial rollouts on the built-in engine: a weight update interrupts running requests, which
resume under the new weights keeping every token and logprob they had sampled."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engines.base import FinishReason, GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from enginetest import load_reference, reference_greedy, reference_logprobs

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


async def tokens_reach(engine: BuiltinEngine, generated: int) -> None:
    """Poll the engine's own token counter (not wall-clock time)."""
    for _ in range(100_000):
        if engine.stats().generated_tokens >= generated:
            return
        await asyncio.sleep(0.0005)
    raise AssertionError(f"engine did not generate {generated} tokens")


async def test_an_interrupted_request_resumes_under_the_new_weights_with_its_tokens_and_budget(model_dir, other_model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=4, seed=0, partial=True)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0))))
        await tokens_reach(engine, 5)
        await engine.update_weights(path=str(other_model_dir), version=3)
        result = await running
        assert engine.stats().generated_tokens < 45  # the update did not wait for the request to end
    finally:
        engine.close()
    k = result.output_versions.count(0)
    assert 5 <= k < 40 and result.output_versions == [0] * k + [3] * (40 - k)
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 40  # one budget across both
    old, new = load_reference(model_dir), load_reference(other_model_dir)
    assert result.output_ids[:k] == reference_greedy(old, PROMPT, k)
    assert result.output_ids[k:] == reference_greedy(new, PROMPT + result.output_ids[:k], 40 - k)
    assert result.logprobs[:k] == pytest.approx(reference_logprobs(old, PROMPT, result.output_ids[:k], 0.0), abs=1e-5)
    assert result.logprobs[k:] == pytest.approx(
        reference_logprobs(new, PROMPT + result.output_ids[:k], result.output_ids[k:], 0.0), abs=1e-5)
    assert result.weight_version == 3


async def test_repeated_interruptions_with_unchanged_weights_sample_what_an_uninterrupted_run_samples(model_dir):
    """Sampled (temperature 1, seeded): each interruption keeps the tokens and logprobs so far
    (bit for bit until the first one) and the resumed request draws the same tokens."""
    state = {k: v.clone() for k, v in load_reference(model_dir).state_dict().items() if k != "lm_head.weight"}
    request = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=48, temperature=1.0, seed=11))
    plain = BuiltinEngine(model_dir, max_batch_size=4, seed=0)
    try:
        expected = await plain.generate(request)
    finally:
        plain.close()
    engine = BuiltinEngine(model_dir, max_batch_size=4, seed=0, partial=True)
    try:
        running = asyncio.create_task(engine.generate(request))
        for i, at in enumerate((4, 14, 26)):
            await tokens_reach(engine, at)
            await engine.update_weights(state, version=i + 1)
        result = await running
        stats = engine.stats()
    finally:
        engine.close()
    assert result.output_ids == expected.output_ids and len(result.output_ids) == 48
    first = result.output_versions.count(0)
    assert first >= 4 and result.output_versions == sorted(result.output_versions)
    assert set(result.output_versions) <= {0, 1, 2, 3} and result.output_versions[-1] == 3
    assert result.logprobs[:first] == expected.logprobs[:first]  # kept exactly
    assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-5)  # resumed: prefilled again
    assert (stats.interrupted_requests, stats.resumed_requests) == (3, 3)


async def test_without_partial_an_update_still_drains(model_dir, other_model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=4, seed=0)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=30, temperature=0.0))))
        await tokens_reach(engine, 3)
        await engine.update_weights(path=str(other_model_dir))
        result = await running
        assert (result.weight_version, result.output_versions, engine.stats().interrupted_requests) == (0, [], 0)
    finally:
        engine.close()

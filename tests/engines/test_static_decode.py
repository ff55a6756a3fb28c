"""The static decode path (``_graphs.StaticDecode``: rows padded to a bucket, a scratch slot,
attention over every slot and the cache's whole capacity; replayed as CUDA graphs on a GPU) gives
the default path's tokens and logprobs. On the CPU it runs eagerly (``decode_graphs=True``): the
layout, the padding and the scheduling around it are what these tests check."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.engines._graphs import buckets
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 17, 42, 99, 3, 64, 128, 7], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 201], [33]]


def run(engine: BuiltinEngine, requests: list[GenerateRequest]):
    async def main():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(main())


def requests(temperature: float, new_tokens: int = 40) -> list[GenerateRequest]:
    return [GenerateRequest(p, SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=11 + i), rid=f"r{i}")
            for i, p in enumerate(PROMPTS)]


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_decode_gives_the_default_paths_tokens_and_logprobs(model_dir, temperature):
    results = {}
    for static in (False, True):
        engine = BuiltinEngine(model_dir, max_batch_size=6, seed=0, decode_graphs=static)
        try:
            results[static] = run(engine, requests(temperature))
            # a second round reuses prefixes (the finished requests' slots) and grows nothing
            results[static] += run(engine, requests(temperature, new_tokens=8))
            decoder = engine._scheduler.static_decode
            if static:
                assert decoder is not None and decoder.steps > 0 and decoder.replays == 0  # no graphs on the CPU
                assert engine._scheduler.cache.slots == 7  # the scratch slot
            else:
                assert decoder is None and engine._scheduler.cache.slots == 6
        finally:
            engine.close()
    for default, static in zip(results[False], results[True]):
        assert static.output_ids == default.output_ids
        assert static.logprobs == pytest.approx(default.logprobs, abs=1e-5)


def test_the_scratch_slot_is_never_given_to_a_request(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=3, seed=0, decode_graphs=True)
    try:
        scheduler = engine._scheduler
        assert scheduler.static_decode.scratch == 3 and 3 not in scheduler.slots.empty
        seen = set()
        original = scheduler.static_decode.__call__

        class Spy:
            def __call__(self, ids, positions, slots):
                seen.update(slots)
                return original(ids, positions, slots)

        scheduler.static_decode = type("S", (), {"__call__": Spy().__call__, "scratch": 3})()
        run(engine, [GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=1.0, seed=i), rid=f"s{i}")
                     for i, p in enumerate(PROMPTS)])  # five requests through three slots
        assert seen and 3 not in seen and seen <= {0, 1, 2}
    finally:
        engine.close()


def test_padded_rows_leave_the_requests_cache_untouched(model_dir):
    """Rows padded to the bucket write only the scratch slot: the same request decoded alone
    (bucket 1, no padding) and beside two others (bucket 4, one padded row) agree."""
    alone = BuiltinEngine(model_dir, max_batch_size=4, seed=0, decode_graphs=True)
    crowd = BuiltinEngine(model_dir, max_batch_size=4, seed=0, decode_graphs=True)
    try:
        (one,) = run(alone, requests(1.0)[:1])
        three = run(crowd, requests(1.0)[:3])
    finally:
        alone.close()
        crowd.close()
    assert three[0].output_ids == one.output_ids
    assert three[0].logprobs == pytest.approx(one.logprobs, abs=1e-5)
    assert torch.isfinite(torch.tensor(three[0].logprobs)).all()

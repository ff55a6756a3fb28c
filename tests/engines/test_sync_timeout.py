"""engine.sync_timeout_s: a weight sync that cannot finish fails naming the engine and what it waited for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.errors import EngineTimeout
from agentrl.trainer.workers import _bounded_sync
from enginetest import load_reference

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_a_sync_that_waits_on_a_long_request_past_the_limit_fails_naming_the_engine(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=2, seed=0, max_seq_len=4096)
    worker = SimpleNamespace(engine=engine, rollout_setup=SimpleNamespace(sync_timeout_s=0.3, engine_backend="builtin",
                                                                          server_urls=()))
    state = {k: v for k, v in load_reference(model_dir).state_dict().items() if k != "lm_head.weight"}
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest([5, 17, 42], SamplingParams(max_new_tokens=4000, temperature=0.0))))
        while engine.stats().generated_tokens < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineTimeout, match=r"weight sync to version 4 \(an in-memory copy\) into the built-in engine of "
                                                r"the actor's rank 0 did not finish within engine.sync_timeout_s=0.3 s "
                                                r"\(1 requests running, 0 waiting: a sync drains the running ones first\)"):
            await _bounded_sync(worker, engine.update_weights(state, version=4), 4, "an in-memory copy")
        await engine.abort_all()
        await running
    finally:
        engine.close()

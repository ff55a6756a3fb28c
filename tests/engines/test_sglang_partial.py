"""Partial rollouts through the SGLang client (``SGLangEngine(partial=True)``): a weight update
aborts the servers' running requests, which are sent again as prompt + tokens so far with the rest
of their budget. Against `agentrl serve`'s app in this process (httpx's ASGI transport), whose
built-in engine's token counter says when to interrupt."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.serve import build_app
from agentrl.engines.sglang import SGLangEngine
from enginetest import load_reference, reference_greedy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


class InProcessServer:
    """`agentrl serve` over the built-in engine, reached through an ASGI transport (no sockets).

    ``hold_at(n)``: the engine stops after the step that brings its generated tokens to ``n`` and
    goes on only once an abort of every request (a partial update's) has been queued, so that an
    update interrupts a request at exactly ``n`` tokens however loaded the machine is."""

    def __init__(self, model_dir):
        self.engine = BuiltinEngine(model_dir, max_batch_size=4, seed=0)
        self.transport = httpx.ASGITransport(app=build_app(self.engine, str(model_dir)))
        self._hold_at: int | None = None
        self._held, self._go = threading.Event(), threading.Event()
        scheduler, step, abort_all = self.engine._scheduler, self.engine._scheduler.step, self.engine.abort_all

        def step_then_hold(*args):  # on the engine's worker thread
            step(*args)
            if self._hold_at is not None and scheduler.counters["generated"] >= self._hold_at:
                self._hold_at = None
                self._held.set()
                if not self._go.wait(60):
                    raise AssertionError("the engine held at a token count was not released by an abort within 60 s")
                self._go.clear()

        async def abort_all_then_go():
            await abort_all()  # queued before the worker goes on: its next step applies it
            if self._held.is_set():
                self._held.clear()
                self._go.set()

        scheduler.step, self.engine.abort_all = step_then_hold, abort_all_then_go

    def client(self, **kwargs) -> SGLangEngine:
        return SGLangEngine(["http://served"], transport=self.transport, **kwargs)

    def hold_at(self, generated: int) -> None:
        self._hold_at = generated

    async def held(self) -> None:
        if not await asyncio.to_thread(self._held.wait, 60):
            raise AssertionError(f"the served engine did not reach {self._hold_at} generated tokens within 60 s")

    async def tokens_reach(self, generated: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.engine.stats().generated_tokens < generated:
            if time.monotonic() > deadline:
                raise AssertionError(f"the served engine did not generate {generated} tokens within {timeout_s} s")
            await asyncio.sleep(0.0005)

    def close(self) -> None:
        self._go.set()
        self.engine.close()


@pytest.fixture
def served(model_dir):
    server = InProcessServer(model_dir)
    yield server
    server.close()


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kwargs)


async def generate_through_updates(served: InProcessServer, engine: SGLangEngine, updates: list) -> GenerateResult:
    """A greedy request of 40 tokens held at its 5th, then each ``(path, version)`` update in turn."""
    served.hold_at(5)
    running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(40))))
    await served.held()
    for path, version in updates:
        await engine.update_weights(path=str(path), version=version)
    return await running


async def test_a_request_interrupted_three_times_gives_the_tokens_and_logprobs_of_an_uninterrupted_one(served, model_dir):
    plain = served.client()
    partial = served.client(partial=True)
    try:
        expected = await plain.generate(GenerateRequest(PROMPT, greedy(48)))
        start = served.engine.stats().generated_tokens
        served.hold_at(start + 4)
        running = asyncio.create_task(partial.generate(GenerateRequest(PROMPT, greedy(48), rid="r")))
        for version, at in ((1, 14), (2, 26), (3, None)):
            await served.held()
            if at is not None:
                served.hold_at(start + at)  # the resumed piece stops there for the next update
            await partial.update_weights(path=str(model_dir), version=version)  # the same weights, reloaded
        result = await running
        assert (partial.interrupted_requests, partial.resumed_requests) == (3, 3)
    finally:
        await plain.aclose()
        await partial.aclose()
    assert expected.output_versions == [] and len(expected.output_ids) == 48  # the reference ran whole
    assert result.output_ids == expected.output_ids
    assert result.finish_reason is FinishReason.LENGTH and result.prompt_tokens == len(PROMPT)
    assert result.output_versions == [0] * 4 + [1] * 10 + [2] * 12 + [3] * 22 and result.weight_version == 3
    # the pieces' tokens prefilled again (and the prompt's K/V reused from the reference's request)
    assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


async def test_a_resumed_request_samples_its_remaining_budget_under_the_new_weights(served, model_dir, other_model_dir):
    engine = served.client(partial=True)
    try:
        result = await generate_through_updates(served, engine, [(other_model_dir, 7)])
    finally:
        await engine.aclose()
    k = 5
    assert result.output_versions == [0] * k + [7] * (40 - k)
    assert len(result.output_ids) == 40 and result.finish_reason is FinishReason.LENGTH  # one budget across both pieces
    old, new = load_reference(model_dir), load_reference(other_model_dir)
    assert result.output_ids[:k] == reference_greedy(old, PROMPT, k)
    assert result.output_ids[k:] == reference_greedy(new, PROMPT + result.output_ids[:k], 40 - k)


async def test_a_request_the_caller_aborts_is_not_resumed(served, model_dir):
    engine = served.client(partial=True)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(400), rid="mine")))
        await served.tokens_reach(3)
        await engine.abort("mine")
        result = await running
        assert result.finish_reason is FinishReason.ABORT and 0 < len(result.output_ids) < 400
        assert (engine.interrupted_requests, engine.resumed_requests) == (0, 0)
        assert not engine._cancelled and not engine._resumable  # nothing kept about a finished request
    finally:
        await engine.aclose()


async def test_without_partial_an_update_waits_for_the_running_request(served, model_dir):
    engine = served.client()
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(30))))
        await served.tokens_reach(3)
        await engine.update_weights(path=str(model_dir), version=1)
        result = await running
    finally:
        await engine.aclose()
    assert (result.finish_reason, len(result.output_ids), result.weight_version, result.output_versions) == \
        (FinishReason.LENGTH, 30, 0, [])
    assert engine.interrupted_requests == 0


async def test_a_request_the_caller_aborts_during_an_update_is_not_resumed_after_it(served, model_dir):
    engine = served.client(partial=True)
    try:
        running = asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(400), rid="mine")))
        await served.tokens_reach(3)
        update = asyncio.create_task(engine.update_weights(path=str(model_dir), version=1))
        await asyncio.sleep(0)  # the update has begun: its abort of the running requests is on its way
        await engine.abort("mine")
        result = await running
        await update
        assert result.finish_reason is FinishReason.ABORT and 0 < len(result.output_ids) < 400
        assert engine.resumed_requests == 0
    finally:
        await engine.aclose()


async def test_a_sync_past_engine_sync_timeout_names_the_server_that_did_not_answer_and_its_requests():
    from types import SimpleNamespace

    from agentrl.errors import EngineTimeout
    from agentrl.trainer.workers import _bounded_sync

    async def server(request: httpx.Request) -> httpx.Response:  # b loads the weights; every other call hangs
        if request.url.host == "b" and request.url.path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": True, "message": ""})
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    engine = SGLangEngine(["http://a:1", "http://b:2"], transport=httpx.MockTransport(server))
    worker = SimpleNamespace(engine=engine, rollout_setup=SimpleNamespace(
        sync_timeout_s=0.2, engine_backend="sglang", server_urls=("http://a:1", "http://b:2")))
    try:
        running = [asyncio.create_task(engine.generate(GenerateRequest(PROMPT, greedy(8), session_id=f"s{i}"))) for i in range(3)]
        while engine.servers[0].outstanding < 2:  # the least loaded first: a, b, a
            await asyncio.sleep(0.001)
        with pytest.raises(EngineTimeout, match=r"weight sync to version 1 \(a reload from /w\) into the SGLang server\(s\) "
                                                r"http://a:1, http://b:2 did not finish within engine.sync_timeout_s=0.2 s "
                                                r"\(http://a:1/update_weights_from_disk not answered, 2 requests of this "
                                                r"engine running there\)$"):
            await _bounded_sync(worker, engine.update_weights(path="/w", version=1), 1, "a reload from /w")
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    finally:
        await engine.aclose()


async def test_a_request_woken_by_one_update_waits_for_the_next_that_began_before_it_was_sent(served, model_dir):
    """Two updates back to back: the first one's end wakes the interrupted request, but the second
    begins before the request runs again; it must wait for that one too, not be sent into it (the
    second update's abort would end it for good, as a request no update interrupted)."""
    engine = served.client(partial=True)
    try:  # no turn of the loop between the two updates
        result = await generate_through_updates(served, engine, [(model_dir, 1), (model_dir, 2)])
    finally:
        await engine.aclose()
    assert (result.finish_reason, len(result.output_ids)) == (FinishReason.LENGTH, 40)
    assert result.output_versions == [0] * 5 + [2] * 35  # nothing sampled under version 1
    assert (engine.interrupted_requests, engine.resumed_requests) == (1, 1)

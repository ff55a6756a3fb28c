"""Request priorities in the built-in engine: waiting requests are admitted lowest priority first,
first come first served within one (asynchronous training's oldest batch first, agent/async_rollout.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest

from agentrl.engines._scheduler import Scheduler
from agentrl.engines.base import REQUEST_PRIORITY, GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def _queue(*entries: tuple[str, int, bool]) -> list[str]:
    """The waiting queue's names after enqueueing (name, priority, ahead) in order."""
    owner = SimpleNamespace(waiting=deque())
    for name, priority, ahead in entries:
        Scheduler.enqueue(owner, SimpleNamespace(name=name, request=SimpleNamespace(priority=priority)), ahead=ahead)
    return [seq.name for seq in owner.waiting]


def test_the_queue_keeps_priority_order_and_arrival_order_within_a_priority():
    assert _queue(("a", 0, False), ("b", 0, False), ("c", 0, False)) == ["a", "b", "c"]  # no priorities: first come
    assert _queue(("a", 2, False), ("b", 0, False), ("c", 1, False), ("d", 0, False), ("e", 2, False)) == \
        ["b", "d", "c", "a", "e"]


def test_an_interrupted_request_goes_ahead_of_its_own_priority_only():
    # interrupt_running puts the running ones back from the last to the first, each ahead of its priority
    waiting = [("w0", 0, False), ("w1", 1, False), ("w2", 1, False), ("w3", 2, False)]
    assert _queue(*waiting, ("r1b", 1, True), ("r1a", 1, True), ("r3", 3, True), ("r0", 0, True)) == \
        ["r0", "w0", "r1a", "r1b", "w1", "w2", "w3", "r3"]
    assert _queue(("a", 0, False), ("r2", 0, True), ("r1", 0, True)) == ["r1", "r2", "a"]  # as appendleft did


async def test_a_request_takes_the_priority_of_the_task_that_builds_it():
    assert GenerateRequest([1]).priority == 0 and GenerateRequest([1], priority=3).priority == 3

    async def build() -> int:
        REQUEST_PRIORITY.set(7)
        inner = await asyncio.gather(asyncio.sleep(0, GenerateRequest([1])))  # a task it starts inherits it
        return GenerateRequest([1]).priority * 100 + inner[0].priority

    assert await asyncio.create_task(build()) == 707
    assert GenerateRequest([1]).priority == 0  # set in that task only


async def test_the_engine_admits_the_lowest_priority_first(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=1, seed=0)
    try:
        def request(rid: str, priority: int, tokens: int) -> GenerateRequest:
            return GenerateRequest([5, 17, 42], SamplingParams(max_new_tokens=tokens, temperature=0.0, stop_token_ids=()),
                                   rid=rid, priority=priority)

        first = asyncio.create_task(engine.generate(request("busy", 9, 24)))
        while engine.stats().generated_tokens < 1:  # the one slot is taken: the next ones wait together
            await asyncio.sleep(0.0005)
        rest = [asyncio.create_task(engine.generate(request(rid, p, 2))) for rid, p in
                [("late-2", 2), ("late-0a", 0), ("late-1", 1), ("late-0b", 0)]]
        await asyncio.gather(first, *rest)
        admitted = [rid for rec in engine.step_log for rid in rec.prefill_rids]
    finally:
        engine.close()
    assert admitted == ["busy", "late-0a", "late-0b", "late-1", "late-2"]

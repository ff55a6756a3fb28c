"""Parked prefixes (``engines/_parking.py``): a conversation's K/V moved out of a retained slot that
another request needs, found again by its next turn (only its own), bounded with the latest
batch's conversations dropped first, dropped by a weight update; in the engine, a next turn after
its slot was taken prefills only its new tokens and samples what it would have sampled anyway."""

from __future__ import annotations

import pytest
import torch

from agentrl.engines._prefix_cache import Slots
from agentrl.engines._ragged import SlotKVCache
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def cache(slots: int = 2, capacity: int = 8) -> SlotKVCache:
    """A cache whose K/V at (slot, position) hold 100 * slot + position (every layer, head, dim)."""
    kv = SlotKVCache(num_layers=2, slots=slots, kv_heads=1, head_dim=2, max_len=64, dtype=torch.float32,
                     device=torch.device("cpu"), initial_len=capacity)
    with torch.inference_mode():
        for layer in kv.keys + kv.values:
            layer.copy_((100 * torch.arange(slots)[:, None] + torch.arange(capacity)[None, :])[:, None, :, None].expand_as(layer))
    return kv


def held(kv: SlotKVCache, slot: int, length: int) -> list[float]:
    return kv.keys[0][slot, 0, :length, 0].tolist()


def test_a_taken_slot_parks_its_conversation_and_the_next_turn_gets_it_back_in_another_slot():
    kv = cache()
    slots = Slots(kv)
    a, b = slots.acquire(None, 0)[0], slots.acquire(None, 0)[0]
    assert (a, b) == (0, 1)
    slots.release(a, [7, 8, 9], session="conv-a", priority=0)
    slots.release(b, [5, 6], session="conv-b", priority=0)
    c, _ = slots.acquire(None, 0)  # a third request: the least recently used retained slot (a) is taken
    assert c == a and len(slots.parked) == 1 and slots.parked.positions == 3
    with torch.inference_mode():
        kv.keys[0][a].fill_(-1.0)  # the new request writes over the slot
    # the conversation's next turn: its parked K/V are its longest prefix; another conversation's are not
    assert slots.best_prefix([7, 8, 9, 4, 4], {}, "conv-a") == ("conv-a", 3)
    assert slots.best_prefix([7, 8, 9, 4, 4], {}, "conv-x") == (None, 0)
    slot, shared = slots.acquire("conv-a", 3)
    assert (slot, shared) == (b, 3)  # b's own K/V parked in turn to make room
    assert held(kv, slot, 3) == [0.0, 1.0, 2.0]  # slot a's positions 0..2, as they were
    assert len(slots.parked) == 1 and slots.best_prefix([5, 6, 1], {}, "conv-b") == ("conv-b", 2)


def test_over_the_budget_the_latest_batchs_conversations_go_first_and_a_weight_update_drops_them_all():
    kv = cache(slots=1, capacity=4)  # budget: 2 x 1 slot x 4 positions = 8
    slots = Slots(kv)
    assert slots.parked.park(0, [1, 2, 3], "late", priority=5)
    assert slots.parked.park(0, [1, 2, 3], "early", priority=1)
    assert slots.parked.park(0, [4, 4], "early-2", priority=1)
    assert slots.parked.park(0, [1, 2, 3], "middle", priority=3)  # over budget: the latest batch's ("late") goes
    assert slots.parked.length_for("late", [1, 2, 3, 9], 3) == 0
    assert not slots.parked.park(0, [1, 2, 3], "later", priority=9)  # everything parked is wanted sooner
    assert [s for s in ("early", "early-2", "middle") if slots.parked.length_for(s, [1, 2, 3, 4, 4], 4)] == ["early", "middle"]
    assert slots.parked.positions == 8
    slots.drop_retained()  # a weight update: their K/V came from the old weights
    assert len(slots.parked) == 0 and slots.parked.positions == 0


async def test_a_next_turn_whose_slot_was_taken_prefills_only_its_new_tokens_and_samples_the_same(model_dir):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    first, other = [5, 17, 42, 99, 3, 64], [9, 8, 7, 6, 5, 4, 3]

    async def turns(engine: BuiltinEngine, detour: bool) -> tuple[list[int], int]:
        one = await engine.generate(GenerateRequest(first, greedy, session_id="a"))
        if detour:  # another conversation takes the only slot in between
            await engine.generate(GenerateRequest(other, greedy, session_id="b"))
        before = engine.stats().prefill_tokens
        two = await engine.generate(GenerateRequest(first + one.output_ids + [11, 12], greedy, session_id="a"))
        return two.output_ids, engine.stats().prefill_tokens - before

    engine = BuiltinEngine(model_dir, max_batch_size=1, seed=0)
    try:
        straight = await turns(engine, detour=False)
    finally:
        engine.close()
    engine = BuiltinEngine(model_dir, max_batch_size=1, seed=0)
    try:
        parked = await turns(engine, detour=True)
    finally:
        engine.close()
    # the new turn's tokens: the last sampled token (no K/V yet) and the two appended
    assert straight[1] == parked[1] == 3
    assert parked[0] == straight[0]

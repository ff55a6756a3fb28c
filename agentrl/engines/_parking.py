"""Parked prefixes: a conversation's K/V kept when its slot is taken by another request.

A finished request's K/V stay in its slot (``_prefix_cache.Slots``) until a new request needs the
slot. Where more conversations are in flight than the engine has slots (asynchronous training
keeps ``(eta + 1)`` batches of episodes going, several times the engine's batch), every slot is
soon needed: without parking, a conversation's next turn found its K/V gone and prefilled its
whole context again, most of the prefill of such a run (docs/benchmarks.md, "Compute-heavy
workload"). Parking copies the K/V out of the slot before it is reused, keyed by the request's
``session_id`` (the conversation), and the next turn of that conversation copies them into
whatever slot it gets: a copy of memory instead of a forward pass over the context. The running
requests keep the low slots, so decode attention reads no more slots than before.

Bounded: at most ``PARKED_CACHE_FACTOR`` times the slot cache's own positions; past it the
conversation of the latest batch (the highest ``priority``, the last to be admitted again) goes
first, the least recently parked first among equals. A weight update drops them all (their K/V
came from the old weights), as it drops the slots' retained prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from agentrl.engines import _ragged

__all__ = ["ParkedPrefixes", "PARKED_CACHE_FACTOR"]

# parked K/V at most this many times the slot cache's positions: twice the engine's K/V memory
# at most, which covers the contexts waiting for a turn at eta 4 on the bench's batch
PARKED_CACHE_FACTOR = 2


@dataclass(slots=True)
class _Parked:
    tokens: list[int]
    keys: list[torch.Tensor]  # per layer [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    priority: int


class ParkedPrefixes:
    """Conversations' K/V moved out of the slot cache, by ``session_id`` (see the module docstring)."""

    def __init__(self, cache: _ragged.SlotKVCache, *, factor: int = PARKED_CACHE_FACTOR):
        self.cache = cache
        self.factor = factor
        self._by_session: OrderedDict[str, _Parked] = OrderedDict()  # least recently parked first
        self.positions = 0  # parked positions, all conversations

    def __len__(self) -> int:
        return len(self._by_session)

    @torch.inference_mode()  # the cache tensors are inference tensors
    def park(self, slot: int, tokens: list[int], session: str, priority: int) -> bool:
        """Copy the K/V of ``tokens`` out of ``slot`` for the conversation ``session``; False when
        there is no room for it without dropping a conversation wanted sooner."""
        self.discard(session)
        length = len(tokens)
        if not length or not self._make_room(length, priority):
            return False
        keys = [layer[slot, :, :length].clone() for layer in self.cache.keys]
        values = [layer[slot, :, :length].clone() for layer in self.cache.values]
        self._by_session[session] = _Parked(list(tokens), keys, values, priority)
        self.positions += length
        return True

    def length_for(self, session: str | None, tokens: list[int], limit: int) -> int:
        """How many leading positions of ``tokens`` the conversation's parked K/V hold (all it
        holds, when that starts ``tokens`` and is at most ``limit``), else 0."""
        parked = self._by_session.get(session) if session is not None else None
        if parked is None or len(parked.tokens) > limit or tokens[: len(parked.tokens)] != parked.tokens:
            return 0
        return len(parked.tokens)

    def take(self, session: str) -> _Parked:
        """Remove the conversation's parked K/V and return them (``restore`` them into a slot)."""
        parked = self._by_session.pop(session)
        self.positions -= len(parked.tokens)
        return parked

    def put_back(self, session: str, parked: _Parked) -> None:
        """Park again what ``take`` returned (its owner used only part of it), if there is room."""
        if self._make_room(len(parked.tokens), parked.priority):
            self._by_session[session] = parked
            self.positions += len(parked.tokens)

    @torch.inference_mode()
    def restore(self, parked: _Parked, slot: int, length: int) -> None:
        """Copy the first ``length`` parked positions into ``slot``."""
        for layer, saved in zip(self.cache.keys + self.cache.values, parked.keys + parked.values):
            layer[slot, :, :length].copy_(saved[:, :length])

    def discard(self, session: str) -> None:
        if session in self._by_session:
            self.take(session)

    def clear(self) -> None:
        self._by_session.clear()
        self.positions = 0

    def _make_room(self, length: int, priority: int) -> bool:
        budget = self.factor * self.cache.slots * self.cache.capacity
        if length > budget:
            return False
        while self.positions + length > budget:
            # the latest batch's conversation, the least recently parked among them
            worst = max(p.priority for p in self._by_session.values())
            if worst < priority:
                return False  # everything parked is wanted before this one
            victim = next(s for s, p in self._by_session.items() if p.priority == worst)
            self.take(victim)
        return True

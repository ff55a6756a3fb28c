"""Prefix reuse for the built-in engine: which KV slots are free, which keep a finished request's K/V,
and which slot holds the longest prefix of a new request.

A finished request leaves its K/V in its slot. A new request whose tokens start with a retained
slot's tokens (the next turn of a conversation, another sample of the same prompt, a shared system
prompt) reuses them: it takes the slot over when it extends all of it, otherwise it copies the
shared prefix, and only the rest is prefilled. A running request's slot lends its prefix the same
way (by copy), and so does a request admitted in the same step: a request that shares more tokens
with one admitted alongside it than with any cached slot copies them inside the step, layer by
layer, right after they are computed (``_ragged.PrefixCopy``, ``resolve_copy``), so the n samples
of a GRPO group that arrive together compute their prompt once, in one step. A retained slot
that a new request needs has its conversation's K/V parked first (``_parking.py``), where its
next turn finds them.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict

from agentrl.engines import _ragged
from agentrl.engines._parking import ParkedPrefixes

__all__ = ["Slots", "longest_shared", "resolve_copy"]

_PARTIAL_PREFIX_CANDIDATES = 8  # slots examined for a partial prefix match per admission


class Slots:
    """Which KV slots are free, and which free ones still hold a finished request's K/V."""

    def __init__(self, cache: _ragged.SlotKVCache):
        self.cache = cache
        self.empty = list(range(cache.slots))  # heap: the lowest slot first keeps the decode span short
        self.retained: OrderedDict[int, list[int]] = OrderedDict()  # slot -> its cached tokens, LRU first
        self.owners: dict[int, tuple[str, int]] = {}  # retained slot -> its request's (session_id, priority)
        # a conversation's K/V moved out of a retained slot that another request needed (_parking.py)
        self.parked = ParkedPrefixes(cache)

    def acquire(self, donor: int | str | None, shared: int) -> tuple[int, int]:
        """A slot for a request whose first ``shared`` tokens have K/V in slot ``donor`` (found by
        ``best_prefix``; a session id: parked K/V), and how many leading tokens have K/V in the
        returned slot. A running request's slot lends its prefix by copy but is never taken over."""
        if isinstance(donor, str):  # out of the parking first: freeing a slot may park (and drop) others
            parked = self.parked.take(donor)
            slot = self._take_free(avoid=None)
            self.parked.restore(parked, slot, shared)
            if shared < len(parked.tokens):  # only part of it is this request's: kept for another
                self.parked.put_back(donor, parked)
            return slot, shared
        if donor in self.retained and shared >= len(self.retained[donor]):
            del self.retained[donor]  # the request extends everything the slot holds: take it over
            self.owners.pop(donor, None)
            return donor, shared
        slot = self._take_free(avoid=donor if donor in self.retained else None)
        if donor is None:
            return slot, 0
        if slot != donor:
            self.cache.copy_prefix(donor, slot, shared)
        return slot, shared  # (slot == donor when it was the only slot left: its K/V are still there)

    def release(self, slot: int, cached_tokens: list[int], *, session: str | None = None, priority: int = 0) -> None:
        """Free a finished request's slot, retaining ``cached_tokens``' K/V in it (none: empty);
        ``session``: its conversation, whose K/V are parked when the slot is needed."""
        if cached_tokens:
            self.retained[slot] = cached_tokens
            if session is not None:
                self.owners[slot] = (session, priority)
        else:
            heapq.heappush(self.empty, slot)

    def drop_retained(self) -> None:
        for slot in self.retained:
            heapq.heappush(self.empty, slot)
        self.retained.clear()
        self.owners.clear()
        self.parked.clear()

    def _take_free(self, avoid: int | None) -> int:
        if self.empty:
            return heapq.heappop(self.empty)
        for slot in self.retained:  # evict the least recently used retained slot
            if slot != avoid:
                return self._evict(slot)
        return self._evict(avoid)  # type: ignore[arg-type]

    def _evict(self, slot: int) -> int:
        tokens = self.retained.pop(slot)
        if slot in self.owners:  # a conversation's: its next turn finds them parked
            session, priority = self.owners.pop(slot)
            self.parked.park(slot, tokens, session, priority)
        return slot

    def best_prefix(self, tokens: list[int], live: dict[int, list[int]],
                    session: str | None = None) -> tuple[int | str | None, int]:
        """The slot holding the longest prefix of ``tokens`` (``session``'s own parked K/V: that
        session id), and its length. ``live``: running requests' slots and the tokens whose K/V they hold."""
        limit = len(tokens) - 1  # at least one token must be computed to get next-token logits
        # A retained slot whose whole content starts the request (the next turn of its conversation)
        # is the common case; one C-level list comparison per slot finds it.
        best: int | str | None = None
        best_len = 0
        for slot, cached in self.retained.items():
            if best_len < len(cached) <= limit and tokens[: len(cached)] == cached:
                best, best_len = slot, len(cached)
        if self.parked and (parked := self.parked.length_for(session, tokens, limit)) > best_len:
            return session, parked
        if best is not None:
            return best, best_len
        # Otherwise a partial prefix (another sample of the same prompt, a shared system prompt):
        # measure it on the most recent slots that share at least the first tokens.
        return longest_shared(tokens, [*live.items(), *reversed(self.retained.items())], limit)


def resolve_copy(
    dst: int, src: int, length: int, copied_from: dict[int, tuple[int, int]]
) -> list[_ragged.PrefixCopy]:
    """Copies that give ``dst`` the first ``length`` positions of ``src`` inside one step, taking
    each position from where it is written: a source that itself copied its first positions in
    this step (from its own leader) passes those on from that leader, since all copies of a step
    read the cache at once."""
    if src not in copied_from:
        return [_ragged.PrefixCopy(dst, src, 0, length)]
    origin, copied = copied_from[src]
    head = resolve_copy(dst, origin, min(length, copied), copied_from)
    return head + ([_ragged.PrefixCopy(dst, src, copied, length)] if length > copied else [])


def longest_shared(tokens: list[int], holders: list[tuple[int, list[int]]], limit: int) -> tuple[int | None, int]:
    """Among ``(key, tokens)`` holders that start like ``tokens``, the one sharing the longest
    prefix (at most ``limit``) and that length; only the first few candidates are measured."""
    best, best_len = None, 0
    probe = min(4, limit)
    if not probe:
        return best, best_len
    head = tokens[:probe]
    candidates = [(key, held) for key, held in holders if held[:probe] == head]
    for key, held in candidates[:_PARTIAL_PREFIX_CANDIDATES]:
        shared = _common_prefix(held, tokens, limit)
        if shared > best_len:
            best, best_len = key, shared
    return best, best_len


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b (at most ``limit``), by bisection on slice equality."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    return bisect.bisect_left(range(hi), True, key=lambda n: a[: n + 1] != b[: n + 1])

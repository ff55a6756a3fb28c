"""Ragged attention over a slot KV cache, plugged into transformers' attention interface.

The built-in engine runs one forward per step over a *packed* sequence of tokens: first one
decode token for every decoding request, then the prompt tokens of the requests admitted this
step. All linear layers (the bulk of the FLOPs) therefore see one ``[1, T, hidden]`` matrix, with
no padding. Only attention needs to know which token belongs to which request; it is replaced
by ``ragged_attention``, registered under the name ``ATTENTION_NAME`` and fed a ``StepLayout``
through the forward's keyword arguments (transformers passes unknown kwargs down to attention).

The KV cache is a fixed set of *slots*: per layer a ``[slots, kv_heads, capacity, head_dim]``
tensor. A request owns one slot for its lifetime and writes each token's K/V in place, so nothing
is copied from step to step. On the CPU in fp32, decode attention is one native call per layer
that reads each row's K/V over its own length (``_decode_kernel.py``); elsewhere, or without a C
compiler, it reads the slot range ``[:span]`` as a view through batched matrix products, with a
mask for each row's length (free slots inside the range are masked rows whose output is
discarded). A finished request's slot keeps its K/V, so the next turn of the same conversation can
reuse the shared prefix (see ``_prefix_cache.py``). The capacity grows by doubling when a request needs
more positions, which is the only time the cache is copied.

A model called without a ``StepLayout`` (e.g. a plain ``model(input_ids)`` elsewhere in the
process) falls back to transformers' SDPA attention, so registering this does not change a model
for anyone else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrl.engines import _decode_kernel

# transformers' attention registries are imported where they are used: importing them loads its
# quantization integrations (about 1.4 s), which a process that never runs a forward (the driver)
# should not pay.

__all__ = [
    "ATTENTION_NAME", "LAYOUT_KWARG", "SHORT_SPAN", "SlotKVCache", "PrefillSpan", "PrefixCopy", "ShortPrefills",
    "StepLayout", "attend", "build_layout", "install",
]

ATTENTION_NAME = "agentrl_ragged"
LAYOUT_KWARG = "agentrl_layout"


class SlotKVCache:
    """Per-layer K/V tensors ``[slots, kv_heads, capacity, head_dim]``, grown by doubling."""

    def __init__(
        self,
        *,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
        query_heads: int | None = None,
    ):
        self.slots, self.kv_heads, self.head_dim, self.max_len = slots, kv_heads, head_dim, max_len
        # the shape the native decode kernel is compiled for (None: its generic loops)
        self.kernel_shape = None if query_heads is None else (query_heads // kv_heads, head_dim)
        self.capacity = min(initial_len, max_len)
        shape = (slots, kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def ensure_capacity(self, length: int) -> None:
        """Make room for ``length`` positions in every slot (copies the cache when it grows)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"KV cache length {length} exceeds max_seq_len {self.max_len}")
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity *= 2
        new_capacity = min(new_capacity, self.max_len)
        for tensors in (self.keys, self.values):
            for layer, old in enumerate(tensors):
                grown = old.new_zeros((self.slots, self.kv_heads, new_capacity, self.head_dim))
                grown[:, :, : self.capacity].copy_(old)
                tensors[layer] = grown
        self.capacity = new_capacity

    @torch.inference_mode()  # the cache tensors are inference tensors (made inside the step)
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[dst, :, :length].copy_(layer[src, :, :length])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """Prompt tokens of one request in this step: positions [start, start+length) of its slot."""

    slot: int
    start: int  # tokens already in the slot's cache (a reused prefix); 0 for a fresh prompt
    length: int
    offset: int  # index of its first token in the packed step


@dataclass(frozen=True, slots=True)
class PrefixCopy:
    """Positions [start, end) of slot ``src`` copied into slot ``dst`` inside a step, in every layer
    after the step's K/V are written and before attention: a request admitted together with one
    that computes a shared prefix (another sample of the same prompt) takes it from there."""

    dst: int
    src: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ShortPrefills:
    """Short prefill spans attended in one padded batch (S spans, Tp tokens, at most ``SHORT_SPAN``
    each): one attention call per layer instead of one per span. This is the common case of a
    step that admits many requests whose prompts are mostly reused (the samples of a group, the
    next turns of many conversations): a few new tokens each, where per-span calls cost far more
    than their arithmetic."""

    rows: torch.Tensor  # [Tp] int64: the tokens' rows in the packed step
    token_slots: torch.Tensor  # [Tp] int64: where each token's K/V is written ...
    token_positions: torch.Tensor  # [Tp] int64: ... and at which position
    span_slots: torch.Tensor  # [S] int64
    flat_index: torch.Tensor  # [Tp] int64: each token's place in the padded [S * longest] queries
    longest: int  # the longest span
    kv_len: int  # keys attended: positions [0, kv_len) of each span's slot
    mask: torch.Tensor  # [S, 1, 1, longest, kv_len] float: 0 where a query sees a key, -inf elsewhere


@dataclass(slots=True)
class StepLayout:
    """Where each packed token of one forward step lives in the cache."""

    cache: SlotKVCache
    num_decode: int  # the first num_decode packed tokens are one decode token per request
    decode_slots: torch.Tensor | None  # [num_decode] int64
    decode_positions: torch.Tensor | None  # [num_decode] int64: where each new K/V is written
    decode_span: int  # decode attention runs over slots [:decode_span]
    decode_dense: bool  # decode_slots == arange(decode_span): no scatter/gather needed
    decode_mask: torch.Tensor | None  # [decode_span, 1, 1, kv_len] float: 0 where a row attends, -inf elsewhere (None: native)
    prefills: tuple[PrefillSpan, ...]  # spans attended one by one (the long ones)
    short: ShortPrefills | None = None  # spans attended together
    # in-step prefix copies, as flat (dst slot, src slot, position) index tensors [N] each
    copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [num_decode] int64: each decode row's own context length (position + 1), set where the native
    # decode kernel (``_decode_kernel.py``) attends the decode rows, each over its own length
    decode_lengths: torch.Tensor | None = None


# Spans up to this many tokens are batched (padding a batch to a long span would waste more than
# separate calls cost); at least two are needed for a batch to pay.
SHORT_SPAN = 32


def build_layout(
    cache: SlotKVCache,
    decode_slots: list[int],
    decode_positions: list[int],
    prefills: tuple[PrefillSpan, ...],
    device: torch.device,
    copies: tuple[PrefixCopy, ...] = (),
) -> StepLayout:
    """Build the layout for one step; decode rows are attended over ``[:max slot + 1]``."""
    short_spans = [p for p in prefills if p.length <= SHORT_SPAN]
    short = None
    if len(short_spans) >= 2:
        short = _short_prefills(short_spans, device)
        prefills = tuple(p for p in prefills if p.length > SHORT_SPAN)
    flat_copies = _flat_copies(copies, device) if copies else None
    if not decode_slots:
        return StepLayout(cache, 0, None, None, 0, True, None, prefills, short, flat_copies)
    span = max(decode_slots) + 1
    kv_len = max(decode_positions) + 1
    lengths = torch.ones(span, dtype=torch.int64)  # rows of free slots see position 0 only
    slots_t = torch.tensor(decode_slots, dtype=torch.int64)
    positions_t = torch.tensor(decode_positions, dtype=torch.int64)
    lengths[slots_t] = positions_t + 1
    # the native kernel reads each row's length and needs no mask (one per step, not per layer)
    native = _decode_kernel.DecodeKernel.serves(cache.keys[0]) and _decode_kernel.kernel(cache.kernel_shape) is not None
    mask = None if native else torch.zeros((span, kv_len)).masked_fill_(torch.arange(kv_len)[None, :] >= lengths[:, None], float("-inf"))
    dense = len(decode_slots) == span and decode_slots == sorted(decode_slots)
    return StepLayout(
        cache=cache,
        num_decode=len(decode_slots),
        decode_slots=slots_t.to(device),
        decode_positions=positions_t.to(device),
        decode_span=span,
        decode_dense=dense,
        decode_mask=None if mask is None else mask[:, None, None, :].to(device),
        prefills=prefills,
        short=short,
        copies=flat_copies,
        decode_lengths=positions_t + 1 if native else None,
    )


def _flat_copies(copies: tuple[PrefixCopy, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dst, src, positions = [], [], []
    for c in copies:
        dst.extend([c.dst] * (c.end - c.start))
        src.extend([c.src] * (c.end - c.start))
        positions.extend(range(c.start, c.end))
    return _int64(dst, device), _int64(src, device), _int64(positions, device)


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _short_prefills(spans: list[PrefillSpan], device: torch.device) -> ShortPrefills:
    longest = max(p.length for p in spans)
    kv_len = max(p.start + p.length for p in spans)
    rows, slots, positions, flat = [], [], [], []
    for s, p in enumerate(spans):
        rows.extend(range(p.offset, p.offset + p.length))
        slots.extend([p.slot] * p.length)
        positions.extend(range(p.start, p.start + p.length))
        flat.extend(range(s * longest, s * longest + p.length))
    starts = torch.tensor([p.start for p in spans])[:, None, None]  # [S, 1, 1]
    query = torch.arange(longest)[None, :, None]  # query i of a span sits at position start + i
    key = torch.arange(kv_len)[None, None, :]
    # Padded query rows (i >= length) see the same keys as real ones, so no row is all-masked;
    # their outputs are dropped.
    hidden = key > starts + query  # [S, longest, kv_len]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[:, None, None]  # [S, 1, 1, longest, kv_len]
    return ShortPrefills(
        rows=_int64(rows, device), token_slots=_int64(slots, device), token_positions=_int64(positions, device),
        span_slots=_int64([p.slot for p in spans], device), flat_index=_int64(flat, device), longest=longest, kv_len=kv_len,
        mask=mask.to(device),
    )


def attend(
    layer: int,
    query: torch.Tensor,  # [T, heads, head_dim], rotary applied
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    layout: StepLayout,
    scaling: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, copy in-step prefixes, and attend; returns
    [T, heads, head_dim]. Every write comes before the copies and the copies before any
    attention: a copied prefix may include K/V computed in this very step. (The native kernel
    writes the decode rows' K/V inside the attention: an in-step copy reads and writes only slots
    admitted in this step, never a decoding row's.)"""
    cache_k, cache_v = layout.cache.keys[layer], layout.cache.values[layer]
    total, heads, head_dim = query.shape
    kv_heads = cache_k.shape[1]
    out = query.new_empty((total, heads, head_dim))
    n, short = layout.num_decode, layout.short

    # Each request writes its new K/V at its own positions, in place; the native kernel writes the
    # decode rows' own, each just before reading that row (one fetch of the line, not two).
    native = n > 0 and layout.decode_lengths is not None
    if n and not native:
        cache_k[layout.decode_slots, :, layout.decode_positions] = key[:n]
        cache_v[layout.decode_slots, :, layout.decode_positions] = value[:n]
    if short is not None:
        cache_k[short.token_slots, :, short.token_positions] = key[short.rows]
        cache_v[short.token_slots, :, short.token_positions] = value[short.rows]
    for span in layout.prefills:
        lo, hi = span.offset, span.offset + span.length
        cache_k[span.slot, :, span.start : span.start + span.length] = key[lo:hi].transpose(0, 1)
        cache_v[span.slot, :, span.start : span.start + span.length] = value[lo:hi].transpose(0, 1)
    if layout.copies is not None:
        dst, src, positions = layout.copies
        cache_k[dst, :, positions] = cache_k[src, :, positions]
        cache_v[dst, :, positions] = cache_v[src, :, positions]

    if native:
        # each row over its own length, in one native call (build_layout checked the kernel serves this cache)
        _decode_kernel.kernel(layout.cache.kernel_shape)(query[:n], cache_k, cache_v, layout.decode_slots, layout.decode_lengths,
                                                          scaling, out[:n], key[:n], value[:n])
    elif n:
        span, kv_len = layout.decode_span, layout.decode_mask.shape[-1]
        q = query[:n]  # [n, heads, head_dim]
        if not layout.decode_dense:
            q_rows = q.new_zeros((span, heads, head_dim))
            q_rows[layout.decode_slots] = q
            q = q_rows
        # Grouped-query attention without repeating K/V: query head h reads kv head h // group.
        q = q.reshape(span, kv_heads, heads // kv_heads, head_dim)  # [span, kv_heads, group, head_dim]
        scores = torch.matmul(q, cache_k[:span, :, :kv_len].transpose(-1, -2))  # [span, kv_heads, group, kv_len]
        scores.mul_(scaling).add_(layout.decode_mask)
        attended = torch.matmul(scores.softmax(dim=-1), cache_v[:span, :, :kv_len]).view(span, heads, head_dim)
        out[:n] = attended if layout.decode_dense else attended[layout.decode_slots]

    if short is not None:
        rows = short.rows
        spans, group = short.span_slots.shape[0], heads // kv_heads
        q = query.new_zeros((spans * short.longest, heads, head_dim))
        q[short.flat_index] = query[rows]
        # Plain matmuls with the group's query heads folded into the rows of their kv head, as
        # for decode: on many spans of a few tokens this beats SDPA's CPU kernel with a mask
        # (see docs/benchmarks.md).
        L, kv_len = short.longest, short.kv_len
        q = q.view(spans, L, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(spans, kv_heads, group * L, head_dim)
        k = cache_k[short.span_slots, :, :kv_len]  # [S, kv_heads, kv_len, head_dim]
        v = cache_v[short.span_slots, :, :kv_len]
        scores = torch.matmul(q, k.transpose(-1, -2))  # [S, kv_heads, group * longest, kv_len]
        scores.view(spans, kv_heads, group, L, kv_len).mul_(scaling).add_(short.mask)
        attended = torch.matmul(scores.softmax(dim=-1), v).view(spans, kv_heads, group, L, head_dim)
        out[rows] = attended.permute(0, 3, 1, 2, 4).reshape(spans * short.longest, heads, head_dim)[short.flat_index]

    for span in layout.prefills:
        lo, hi = span.offset, span.offset + span.length
        end = span.start + span.length
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, length, head_dim]
        if span.start == 0:
            k = key[lo:hi].transpose(0, 1)[None]  # [1, kv_heads, length, head_dim]
            v = value[lo:hi].transpose(0, 1)[None]
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            # Query i sits at position start + i and sees positions <= start + i.
            causal = torch.arange(end, device=q.device)[None, :] <= (
                span.start + torch.arange(span.length, device=q.device)[:, None]
            )
            attended = F.scaled_dot_product_attention(
                q,
                cache_k[span.slot : span.slot + 1, :, :end],
                cache_v[span.slot : span.slot + 1, :, :end],
                attn_mask=causal,
                scale=scaling,
                enable_gqa=True,
            )
        out[lo:hi] = attended[0].transpose(0, 1)
    return out


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim], rotary applied
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface entry: ``attend`` when a StepLayout is passed, else SDPA."""
    layout: StepLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    head_dim = query.shape[-1]
    out = attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        layout,
        head_dim**-0.5 if scaling is None else scaling,
    )
    return out.unsqueeze(0), None


def install() -> None:
    """Register the attention (idempotent). Masks for fallback calls come from SDPA's builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)

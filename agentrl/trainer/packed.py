"""The trainer's forward over packed sequences: each shared token once, little padding, one call.

For the decoder families the engine's fast path knows (Qwen2, Qwen3, Llama), a micro-batch goes
through the model as *prefix trees*. A row's tokens are its real prompt tokens and its response
tokens up to the last real one (which is predicted, never fed). Rows whose tokens begin alike
share those tokens: a trie over the rows' token sequences (the same token, at the same position,
under the same parent is one node) is computed once. GRPO's n samples of a prompt share the
prompt (a tree of depth one below it); the earlier segments of a trajectory whose history was
rewritten (``Trajectory.earlier_segments``: segment k + 1's prompt holds segment k's prompt and
a rendering of its turn) share every token up to where the renderings part, whether a token is
a response token in one row and a prompt token in another. A token attends to exactly its
ancestors and itself (a block mask), and keeps its position, so its hidden state is the one
each row containing it would compute on its own: logprobs and gradients are those of one
forward per row, up to float rounding (tests compare both). Each row's outputs are read at the
nodes on its own path.

The trees are laid out depth first: rows sorted by their token sequences (rows that share a
prefix are then adjacent), each row adds the tokens it does not share with the row before it.
A node's subtree is then a run of slots, so the mask is "the key is not after the query, and
the query is inside the key's subtree" (``PackedSegments.end``).

The rows are cut into *segments*, one tree (or a forest) each, batched by ``length_buckets``. A
row joins the current segment while that costs less than a segment of its own: joining adds the
tokens it does not share and attention over a longer segment (the mask is computed densely, so
``pair_cost`` per query-key pair, ``attention_pair_cost``); a segment of its own computes all
its tokens again. Long responses after a short shared prompt (SFT) so get a segment each, GRPO
groups and a trajectory's segments share theirs. A segment grows past ``MAX_SEGMENT_TOKENS``
only while its mask is no bigger than its rows' masks would be apart (the sum of their squared
lengths: a single longer row gets a segment of its own, and rows longer than the cap share in
the memory they would take anyway). A tree bigger than that is cut between rows: the next
segment computes its rows' shared tokens again (exact, less shared).

Used when the module is the plain model (one unwrapped rank, the CPU default): FSDP2 gathers its
sharded parameters in the module forward's hooks, which a functional call would skip, and
gradient checkpointing lives in the modules too. Everything else takes ``prefix.py``'s path,
which shares identical prompts only (rows whose tokens agree beyond their prompts, and the
segments of one trajectory, are computed in full there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from agentrl.engines._packed import fast_decoder_supported, rms_norm, rotate_half
from agentrl.trainer.batch import TrainBatch

__all__ = ["Segment", "RowTokens", "PackedSegments", "ForwardTokens", "packed_supported", "response_lengths", "row_tokens", "pack_segments",
           "attention_pair_cost", "layout", "forward_tokens", "pass_tokens", "packed_hidden", "MAX_SEGMENT_TOKENS"]

# Longest segment: the block mask and the attention scores grow with its square.
MAX_SEGMENT_TOKENS = 1024
# How much slower per FLOP the masked attention runs than the layers' matrix products (CPU, an
# estimate that errs towards separate segments).
MASKED_ATTENTION_SLOWDOWN = 4.0


def packed_supported(model: torch.nn.Module, batch: TrainBatch) -> bool:
    """Whether ``packed_hidden`` computes exactly what the model's own forward would."""
    from torch.distributed.fsdp import FSDPModule

    return (
        not isinstance(model, FSDPModule)
        and not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
        and not (model.training and getattr(model.config, "attention_dropout", 0.0))
        and fast_decoder_supported(model.base_model)
        and batch.prompt_length > 0
        and bool(batch.attention_mask[:, : batch.prompt_length].any(dim=1).all())  # a token predicts response token 0
    )


@dataclass(frozen=True)
class RowTokens:
    """What each row feeds the model: ``ids[b]``/``positions[b]`` are its real prompt tokens, then
    its response tokens but the last real one (``length[b]`` in all, ``prompt[b]`` of them the
    prompt's). ``order``: the rows sorted by their (token, position) sequences, so rows sharing a
    prefix are adjacent; ``common[i]``: how many leading tokens row ``order[i]`` shares with row
    ``order[i - 1]`` (0 for the first)."""

    ids: list[list[int]]
    positions: list[list[int]]
    length: list[int]
    prompt: list[int]
    order: list[int]
    common: list[int]


def response_lengths(batch: TrainBatch) -> torch.Tensor:
    """(B,) columns up to each row's last real response token (at least 1), on the CPU."""
    real = batch.response_attention_mask.bool()
    columns = torch.arange(1, batch.response_length + 1, device=real.device)
    return (real * columns).amax(dim=1).clamp(min=1).cpu()


def row_tokens(batch: TrainBatch, lengths: torch.Tensor) -> RowTokens:
    """The rows' fed tokens (``lengths[b]``: response columns of row b up to its last real token,
    >= 1), sorted, with the prefix each shares with the one before. Vectorised on the CPU, one
    ``tolist`` per field: per-row tensor slicing costs more."""
    P = batch.prompt_length
    ids, positions = batch.input_ids.cpu(), batch.position_ids.cpu()
    real = batch.attention_mask[:, :P].cpu().bool()  # (B, P)
    prompt = real.sum(dim=1)  # (B,)
    length = prompt + lengths.cpu() - 1  # (B,)
    width = int(length.max())
    column = torch.arange(width)[None, :]  # (1, W)
    real_first = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # (B, P): real prompt columns, in order
    from_prompt = real_first.gather(1, column.clamp(max=P - 1).expand(len(ids), -1))
    from_response = (P + column - prompt[:, None]).clamp(min=0, max=ids.shape[1] - 1)
    source = torch.where(column < prompt[:, None], from_prompt, from_response)  # (B, W) batch column of each fed token
    fed_ids, fed_positions = ids.gather(1, source), positions.gather(1, source)
    # one key per (token, position); -1 past a row's end, so a row sorts before its extensions
    keys = torch.where(column < length[:, None], fed_ids * (int(positions.max()) + 1) + fed_positions, -1)
    key_rows, length_list = keys.tolist(), length.tolist()
    order = sorted(range(len(ids)), key=lambda b: key_rows[b][: length_list[b]])
    ordered = keys[order]
    same = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)  # (B - 1, W)
    common = [0] + same.to(torch.int8).cumprod(dim=1).sum(dim=1).tolist()
    return RowTokens(ids=fed_ids.tolist(), positions=fed_positions.tolist(), length=length_list, prompt=prompt.tolist(),
                     order=order, common=common)


@dataclass
class Segment:
    """Rows computed as one tree: ``rows`` in depth-first (sorted) order, ``shared[i]`` the leading
    tokens row ``rows[i]`` takes from the rows before it; ``tokens``: the tree's nodes."""

    tokens: int = 0
    rows: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    apart: int = field(default=0, compare=False)  # the sum of its rows' squared lengths: their masks, one segment each


def pack_segments(tokens: RowTokens, *, share: bool = True, pair_cost: float = 0.0,
                  max_tokens: int | None = None) -> list[Segment]:
    """Cut the sorted rows into segments. A row joins the current segment (the one holding the row
    before it, with which it shares the most) when it shares a token with it and that costs less
    than a segment of its own, in token-equivalents: joining adds its unshared tokens and attention
    over a longer segment (``pair_cost`` per query-key pair), a segment of its own computes all
    its tokens. A segment grows past ``max_tokens`` only while its mask (its length squared) is
    no bigger than its rows' masks would be apart (a segment each, as a single longer row gets):
    long rows share, in the memory they would take alone. ``share=False``: a segment per row."""
    max_tokens = MAX_SEGMENT_TOKENS if max_tokens is None else max_tokens
    segments: list[Segment] = []
    current = Segment()
    for b, common in zip(tokens.order, tokens.common):
        length = tokens.length[b]
        shared = common if share and current.rows else 0
        added, size = length - shared, current.tokens
        fits = size + added <= max_tokens or (size + added) ** 2 <= current.apart + length**2
        joins = shared > 0 and fits and (
            added + pair_cost * ((size + added) ** 2 - size**2) <= length + pair_cost * length**2
        )
        if not joins:
            current, shared, added = Segment(), 0, length
            segments.append(current)
        current.rows.append(b)
        current.shared.append(shared)
        current.tokens += added
        current.apart += length**2
    return segments


def attention_pair_cost(config) -> float:
    """What one query-key pair of the packed attention costs, in tokens' worth of the layers'
    matrix products: 4·heads·head_dim FLOPs (scores and weighted sum) against 2 per weight, times
    ``MASKED_ATTENTION_SLOWDOWN`` (a masked attention kernel runs further below the machine's
    rate than a large matrix product)."""
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config.intermediate_size
    return MASKED_ATTENTION_SLOWDOWN * 4 * heads * head_dim / (2 * weights)


@dataclass(frozen=True)
class ForwardTokens:
    """What a micro-batch costs the packed forward, in tokens: ``computed``, the tree nodes it
    feeds (padding not counted); ``rows``, what one forward per row would feed (each row's real
    prompt and response tokens but its last); ``trained``, the sampled response tokens."""

    computed: int
    rows: int
    trained: int


def forward_tokens(batch: TrainBatch, *, share: bool = True, pair_cost: float = 0.0,
                   max_tokens: int | None = None) -> ForwardTokens:
    """``ForwardTokens`` of the segments ``pack_segments`` cuts ``batch`` into (``pair_cost`` 0:
    the rows' trees, cut at ``max_tokens`` only)."""
    tokens = row_tokens(batch, response_lengths(batch))
    segments = pack_segments(tokens, share=share, pair_cost=pair_cost, max_tokens=max_tokens)
    return ForwardTokens(computed=sum(s.tokens for s in segments), rows=sum(tokens.length),
                         trained=batch.num_sampled_tokens())


def pass_tokens(shards: Sequence[TrainBatch], micro_batch_size: int) -> ForwardTokens:
    """``ForwardTokens`` summed over the micro-batches of one pass over ``shards`` (each rank's
    rows cut into ``micro_batch_size`` rows and trimmed, as the workers do), trees cut at the
    segment cap only (``pair_cost`` 0: the attention-cost choice needs the model's config)."""
    counts = [forward_tokens(micro.trim()) for shard in shards if len(shard) for micro in shard.split(micro_batch_size)]
    return ForwardTokens(*(sum(getattr(c, name) for c in counts) for name in ("computed", "rows", "trained")))


@dataclass(frozen=True)
class PackedSegments:
    """Segments batched for one call, and where each needed prediction lands.

    ``ids``/``positions`` are (S, L), each segment's tree depth first, then padding; ``end`` (S, L)
    is the slot after each node's subtree (a padding slot's: the next slot, so that it sees only
    itself). ``source`` (N,) indexes the flattened (S * L) outputs: the node whose output predicts
    response column ``cols[i]`` of batch row ``rows[i]``."""

    ids: torch.Tensor
    positions: torch.Tensor
    end: torch.Tensor
    source: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(S, 1, L, L) additive: 0 where a query may attend to a key, -inf elsewhere. A key is
        visible to the queries in its subtree: it is the query or one of its ancestors."""
        S, L = self.end.shape
        index = torch.arange(L, device=self.end.device)
        causal = index[None, :] <= index[:, None]  # (L, L) [query, key]
        visible = causal & (index[None, :, None] < self.end[:, None, :])  # (S, L, L)
        return torch.zeros(S, 1, L, L, dtype=dtype, device=self.end.device).masked_fill_(~visible[:, None], float("-inf"))


def layout(tokens: RowTokens, segments: list[Segment], device: torch.device | str) -> PackedSegments:
    """The (S, L) tensors of ``segments`` (right-padded to the longest) and the prediction index."""
    width = max(segment.tokens for segment in segments)
    ids, pos, end, source, out_rows, out_cols = [], [], [], [], [], []
    for s, segment in enumerate(segments):
        base = s * width
        path: list[int] = []  # the current row's nodes, root first (flat indices)
        starts = []
        for b, shared in zip(segment.rows, segment.shared):
            length, prompt = tokens.length[b], tokens.prompt[b]
            starts.append(len(ids) - base)
            path = path[:shared] + list(range(len(ids), len(ids) + length - shared))
            ids += tokens.ids[b][shared:length]
            pos += tokens.positions[b][shared:length]
            # column 0 is predicted by the last prompt token, column t by the row's token prompt + t - 1
            source += path[prompt - 1 : length]
            out_rows += [b] * (length - prompt + 1)
            out_cols += range(length - prompt + 1)
        end += _subtree_ends(segment, tokens.length, starts)
        pad = (s + 1) * width - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        end += range(segment.tokens + 1, width + 1)
    S = len(segments)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedSegments(
        ids=as_long(ids).view(S, width), positions=as_long(pos).view(S, width), end=as_long(end).view(S, width),
        source=as_long(source), rows=as_long(out_rows), cols=as_long(out_cols),
    )


def _subtree_ends(segment: Segment, length: list[int], starts: list[int]) -> list[int]:
    """Each node's subtree end (the segment's own slot index), nodes in layout order. Row i's node
    at depth d is an ancestor of the rows after it up to the first row j that shares at most d
    tokens (rows are sorted: the prefix shared with row i only shrinks); its subtree ends where
    row j's own nodes start. ``later`` holds (shared, start) of the rows after i whose shared is
    below that of every row between them and i: the candidates for j, nearest last."""
    ends: list[list[int]] = []
    later: list[tuple[int, int]] = []
    for i in reversed(range(len(segment.rows))):
        shared = segment.shared[i]
        row_ends = [segment.tokens] * (length[segment.rows[i]] - shared)  # depth shared + k at row_ends[k]
        high = shared + len(row_ends)
        for their_shared, their_start in reversed(later):  # their shared decreases
            low = max(their_shared, shared)
            if low < high:
                row_ends[low - shared : high - shared] = [their_start] * (high - low)
                high = low
            if high <= shared:
                break
        ends.append(row_ends)
        while later and later[-1][0] >= shared:
            later.pop()
        later.append((shared, starts[i]))
    return [e for row_ends in reversed(ends) for e in row_ends]


def packed_hidden(model: torch.nn.Module, packed: PackedSegments) -> torch.Tensor:
    """(N, hidden): the final-norm hidden state of each token listed in ``packed.source``."""
    decoder = model.base_model
    config = decoder.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps, scaling = config.rms_norm_eps, head_dim**-0.5
    S, L = packed.ids.shape
    hidden = F.embedding(packed.ids, decoder.embed_tokens.weight)  # (S, L, hidden)
    width = hidden.shape[-1]
    with torch.no_grad():
        cos, sin = decoder.rotary_emb(hidden, packed.positions)  # (S, L, head_dim)
    cos, sin = cos[:, :, None, :].to(hidden.dtype), sin[:, :, None, :].to(hidden.dtype)  # (S, L, 1, head_dim)
    mask = packed.attention_mask(hidden.dtype)  # (S, 1, L, L)
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = rms_norm(hidden, layer.input_layernorm, width, eps)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(S, L, heads, head_dim)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(S, L, kv_heads, head_dim)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(S, L, kv_heads, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q = rms_norm(q, attn.q_norm, head_dim, eps)
            k = rms_norm(k, attn.k_norm, head_dim, eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scaling, enable_gqa=True,
        )  # (S, heads, L, head_dim)
        hidden = hidden + F.linear(attended.transpose(1, 2).reshape(S, L, heads * head_dim), attn.o_proj.weight, attn.o_proj.bias)
        x = rms_norm(hidden, layer.post_attention_layernorm, width, eps)
        hidden = hidden + F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
    picked = hidden.reshape(S * L, width)[packed.source]  # only the predicting tokens reach the norm and the head
    return rms_norm(picked, decoder.norm, width, eps)

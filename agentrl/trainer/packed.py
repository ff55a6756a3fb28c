"""The trainer's forward over packed sequences: each prompt once, little padding, one call.

For the decoder families the engine's fast path knows (Qwen2, Qwen3, Llama), a micro-batch is
rearranged into *segments*: a distinct prompt's real tokens followed by the response tokens of
the rows sharing it, back to back. A block mask lets each response token see its prompt and the
earlier tokens of its own response, nothing else, and each token keeps the position it has in
the padded layout, so the logits are those of one padded forward (exact up to float rounding;
tests compare logprobs and gradients). The layers are called functionally on the model's own
parameters, as the engine does: on a small model the module tree's per-layer Python and
small-op overhead costs more than the matrix products, forward and backward.

Against ``prefix.py``'s shared-prompt + length-bucket forward this computes the same tokens
(prompts once, responses without padding) in one model call instead of a prompt call plus one
per bucket, with a few dozen ops per layer. A row joins its prompt's segment while that costs
less than a segment of its own (the attention is computed densely over a segment, so long
responses after a short prompt, as in SFT, get a segment each), and no segment grows past
``MAX_SEGMENT_TOKENS``; segments of similar length are batched together by ``length_buckets``.

Used when the module is the plain model (one unwrapped rank, the CPU default): FSDP2 gathers its
sharded parameters in the module forward's hooks, which a functional call would skip, and
gradient checkpointing lives in the modules too. Everything else takes ``prefix.py``'s path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agentrl.engines._packed import fast_decoder_supported, rms_norm, rotate_half
from agentrl.trainer.batch import TrainBatch

__all__ = ["Segment", "PackedSegments", "packed_supported", "pack_segments", "attention_pair_cost", "layout",
           "packed_hidden", "MAX_SEGMENT_TOKENS"]

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
class PackedSegments:
    """Segments batched for one call, and where each needed prediction lands.

    ``ids``/``positions`` are (S, L); ``owner`` (S, L) is -1 on prompt tokens, the batch row on
    a response token, -2 on padding. ``source`` (N,) indexes the flattened (S * L) outputs: the
    token whose output predicts response column ``cols[i]`` of batch row ``rows[i]``."""

    ids: torch.Tensor
    positions: torch.Tensor
    owner: torch.Tensor
    source: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(S, 1, L, L) additive: 0 where a query may attend to a key, -inf elsewhere. A key is
        visible when it is not after the query and is a prompt token or of the query's own row."""
        S, L = self.owner.shape
        index = torch.arange(L, device=self.owner.device)
        causal = index[None, :] <= index[:, None]  # (L, L) [query, key]
        key, query = self.owner[:, None, :], self.owner[:, :, None]
        visible = causal & ((key == -1) | (key == query))  # (S, L, L)
        return torch.zeros(S, 1, L, L, dtype=dtype, device=self.owner.device).masked_fill_(~visible[:, None], float("-inf"))


@dataclass
class Segment:
    """One prompt (``first``: a row holding it) and the rows packed after it; ``tokens``: its length."""

    first: int
    tokens: int
    rows: list[int] = field(default_factory=list)


def pack_segments(batch: TrainBatch, lengths: torch.Tensor, prompt_of: torch.Tensor, *, pair_cost: float = 0.0,
                  max_tokens: int | None = None) -> list[Segment]:
    """Cut the rows into segments with one prompt each, in row order.
    ``lengths[b]``: response columns of row b up to its last real token (>= 1); the last one is
    predicted, never fed, so a row adds ``lengths[b] - 1`` tokens after its prompt.

    A row joins its prompt's open segment when that costs less than a segment of its own, in
    token-equivalents: joining adds its tokens and attention over a longer segment (the block
    mask is computed densely, so ``pair_cost`` per query-key pair, ``attention_pair_cost``),
    a segment of its own adds its prompt again. Short prompts before long responses (SFT, where
    the "prompt" is one token) so get a segment per row, GRPO groups share theirs. No segment
    grows past ``max_tokens`` (a single longer row gets a segment of its own)."""
    max_tokens = MAX_SEGMENT_TOKENS if max_tokens is None else max_tokens
    prompt_tokens = batch.attention_mask[:, : batch.prompt_length].sum(dim=1).tolist()
    open_segment: dict[int, Segment] = {}  # prompt id -> its latest segment
    segments: list[Segment] = []
    for b, (g, length) in enumerate(zip(prompt_of.tolist(), lengths.tolist())):
        added, alone = length - 1, prompt_tokens[b] + length - 1
        current = open_segment.get(g)
        joins = current is not None and current.tokens + added <= max_tokens and (
            added + pair_cost * ((current.tokens + added) ** 2 - current.tokens**2) <= alone + pair_cost * alone**2
        )
        if not joins:
            current = open_segment[g] = Segment(first=b, tokens=prompt_tokens[b])
            segments.append(current)
        current.rows.append(b)
        current.tokens += added
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


def layout(batch: TrainBatch, lengths: torch.Tensor, segments: list[Segment]) -> PackedSegments:
    """The (S, L) tensors of ``segments`` (right-padded to the longest) and the prediction index.
    Built with Python lists from one ``tolist`` per field: per-row tensor slicing costs more."""
    P = batch.prompt_length
    input_ids, positions, attention = batch.input_ids.tolist(), batch.position_ids.tolist(), batch.attention_mask.tolist()
    lengths = lengths.tolist()
    width = max(segment.tokens for segment in segments)
    ids, pos, owner, source, out_rows, out_cols = [], [], [], [], [], []
    for s, segment in enumerate(segments):
        real = [c for c in range(P) if attention[segment.first][c]]
        ids += [input_ids[segment.first][c] for c in real]
        pos += [positions[segment.first][c] for c in real]
        owner += [-1] * len(real)
        last_prompt = s * width + len(real) - 1
        for b in segment.rows:
            n = lengths[b] - 1
            # column 0 is predicted by the last prompt token, column t by response token t - 1
            source.append(last_prompt)
            source.extend(range(len(ids), len(ids) + n))
            out_rows += [b] * (n + 1)
            out_cols += range(n + 1)
            ids += input_ids[b][P : P + n]
            pos += positions[b][P : P + n]
            owner += [b] * n
        pad = (s + 1) * width - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        owner += [-2] * pad
    device, S = batch.input_ids.device, len(segments)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedSegments(
        ids=as_long(ids).view(S, width), positions=as_long(pos).view(S, width), owner=as_long(owner).view(S, width),
        source=as_long(source), rows=as_long(out_rows), cols=as_long(out_cols),
    )


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

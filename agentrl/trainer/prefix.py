"""The trainer's per-response-token outputs (policy logprobs, critic values), computing each
token once and padding little.

Two savings over one forward of the padded ``(B, P + R)`` batch, both exact (same logprobs and
gradients up to float rounding):

* **Shared prompts.** The n samples of a GRPO/RLOO group (and the n trajectories of one
  multi-turn task) share their prompt token for token. The distinct prompts go through the
  model once (``G`` rows instead of ``B``) with their K/V kept in the autograd graph; the K/V are
  indexed out to the rows, and the responses run against them. The indexing's backward sums the
  gradients that reach a prompt from its n responses.
* **Response-length buckets.** Responses end at different lengths (a one-token answer next to a
  long tool-using trajectory); right padding to the longest would compute the padding. Rows are
  sorted by response length and cut into buckets, each trimmed to its own longest response. The
  cut points minimize padded tokens plus a fixed charge per forward call (a call has a cost of
  its own, which the charge stands for, in tokens).

These are the module path's (FSDP2, gradient checkpointing). The packed forward (``packed.py``)
shares more: any leading tokens rows have in common, as prefix trees.

Rows share a prompt when their prompt columns and prompt attention mask are identical (in the
left-padded layout of ``batch.py`` equal prompts are padded identically), so the grouping needs
no group ids and is exact by construction.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.trainer import packed
from agentrl.trainer.algorithms.losses import entropy_from_logprobs
from agentrl.trainer.batch import TrainBatch
from agentrl.trainer.dist import agree_max, needs_agreement

__all__ = ["response_logprobs", "response_values", "distinct_prompts", "length_buckets"]

# What one more forward call is worth, in padded tokens, when choosing buckets. Estimated from
# this CPU's per-call and per-token times: about 15 tokens' worth (18M model) to 60 (1M model).
CALL_COST_TOKENS = 32


def response_logprobs(
    model: torch.nn.Module, batch: TrainBatch, *, temperature: float = 1.0, with_entropy: bool = False,
    share_prompts: bool = True, entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) logprobs of the response tokens under ``model``, and their entropy if asked (else
    None); zeros past each row's last response token. ``entropy_grad=False``: the entropy is a
    metric only (no autograd graph behind it).

    ``temperature`` is the rollout's: engines report ``log_softmax(logits / T)`` of the sampled
    token (``log_softmax(logits)`` when greedy, T = 0), so the trainer scores the same
    distribution, and the PPO ratio is between the policy that sampled and the updated one.
    ``share_prompts=False`` runs every row's prompt in full (no padding is computed either way)."""
    B, P, R = len(batch), batch.prompt_length, batch.response_length
    logprobs = torch.zeros(B, R, device=batch.input_ids.device)
    entropy = torch.zeros(B, R, device=batch.input_ids.device) if with_entropy else None
    for rows, cols, logits in _token_outputs(model, batch, share_prompts):
        logits = logits.float()  # (n, V)
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # shared by logprobs and entropy
        targets = batch.input_ids[rows, P + cols]
        logprobs = logprobs.index_put((rows, cols), logp.gather(-1, targets[:, None])[:, 0])
        if entropy is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy.index_put((rows, cols), entropy_from_logprobs(logp if entropy_grad else logp.detach()))
    return logprobs, entropy


def response_values(model: torch.nn.Module, batch: TrainBatch, *, share_prompts: bool = True) -> torch.Tensor:
    """(B, R) a value head's output at the positions before each response token (``model``
    returns ``.logits`` of width 1, as ``ValueModel`` does); zeros past each row's last token."""
    values = torch.zeros(len(batch), batch.response_length, device=batch.input_ids.device)
    for rows, cols, out in _token_outputs(model, batch, share_prompts):
        values = values.index_put((rows, cols), out[:, 0].float())
    return values


def _token_outputs(model: torch.nn.Module, batch: TrainBatch, share_prompts: bool):
    """Yields ``(rows, cols, outputs)``: the model's (n, ·) outputs at the positions that predict
    response column ``cols[i]`` of batch row ``rows[i]``, every column up to each row's last real
    token exactly once, over one or more calls. The packed forward when the model allows it
    (``packed.py``: the rows as prefix trees, every shared token once), else the distinct prompts
    once and one call per response-length bucket.

    Sharded over several ranks (FSDP2), each model call is a collective, yet how many calls a
    rank's rows need differs (distinct prompts, buckets, buckets of width 1 that need no call).
    The ranks then agree on the largest count and the short ones make empty calls (one token,
    no outputs yielded: their backward adds zero gradient), so every rank makes the same calls."""
    lengths = packed.response_lengths(batch)
    if packed.packed_supported(model, batch):  # prefix trees: every shared token once
        tokens = packed.row_tokens(batch, lengths)
        segments = packed.pack_segments(tokens, share=share_prompts, pair_cost=packed.attention_pair_cost(model.config))
        for bucket in length_buckets(torch.tensor([segment.tokens for segment in segments])):
            layout = packed.layout(tokens, [segments[i] for i in bucket.tolist()], batch.input_ids.device)
            yield layout.rows, layout.cols, model.get_output_embeddings()(packed.packed_hidden(model, layout))
        return
    # transformers returns no K/V from a checkpointed model in training: prompts cannot be shared
    checkpointed = model.training and activation_checkpointing(model)
    if share_prompts and batch.prompt_length > 0 and not checkpointed:
        first, inverse = distinct_prompts(batch)
    else:
        first, inverse = torch.arange(len(batch)), torch.arange(len(batch))
    buckets = length_buckets(lengths)
    use_cache, padding = len(first) < len(batch), 0
    if needs_agreement(model):
        use_cache = share_prompts and batch.prompt_length > 0  # the same graph shape on every rank
        calls = int(use_cache) + sum(1 for rows in buckets if not (use_cache and int(lengths[rows].max()) == 1))
        padding = agree_max(calls, batch.input_ids.device) - calls
    cache = _PromptCache(model, batch, first, inverse) if use_cache else None
    for rows in buckets:
        width = int(lengths[rows].max())
        out = cache.logits(model, batch, rows, width) if cache is not None else _full_logits(model, batch, rows, width)
        # each row's own columns only (the bucket is as wide as its longest row)
        keep = (torch.arange(width)[None, :] < lengths[rows][:, None]).to(out.device)  # (n, width)
        cols = torch.arange(width, device=out.device).expand(len(rows), -1)
        yield rows.to(out.device)[:, None].expand(-1, width)[keep], cols[keep], out[keep]
    for _ in range(padding):
        yield _empty_call(model, batch)


def _empty_call(model: torch.nn.Module, batch: TrainBatch):
    """A call of one token whose output reaches no row: it keeps this rank's calls (FSDP2
    collectives, forward and backward) in step with ranks that need more."""
    device = batch.input_ids.device
    out = model(
        input_ids=batch.input_ids[:1, :1], attention_mask=torch.ones(1, 1, dtype=torch.long, device=device),
        position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, logits_to_keep=1,
    ).logits[0, :0]  # (0, V): empty, yet in the autograd graph
    none = torch.zeros(0, dtype=torch.long, device=device)
    return none, none, out


def distinct_prompts(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: ``first[g]`` is a row holding distinct prompt g (G of them), and row b's
    prompt is ``inverse[b]``."""
    P = batch.prompt_length
    key = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1).cpu()
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(batch))
    first = torch.full((int(inverse.max()) + 1,), len(batch), dtype=torch.long).scatter_reduce_(0, inverse, rows, "amin")
    return first, inverse


def length_buckets(lengths: torch.Tensor, call_cost: int | None = None) -> list[torch.Tensor]:
    """Row indices grouped into buckets of similar length: sorted by length, cut where the padded
    tokens (rows x longest in the bucket) plus ``call_cost`` (default ``CALL_COST_TOKENS``) per
    bucket are least (an exact dynamic program over the cut points; B is a micro-batch, so B^2
    steps are nothing)."""
    call_cost = CALL_COST_TOKENS if call_cost is None else call_cost
    order = torch.argsort(lengths, stable=True)
    sorted_lengths = lengths[order].tolist()
    n = len(sorted_lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = sorted_lengths[j - 1]  # the bucket i..j-1 is as long as its last (longest) row
        for i in range(j):
            cost = best[i] + call_cost + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


class _PromptCache:
    """The distinct prompts' K/V and last-position logits, computed once (with autograd)."""

    def __init__(self, model: torch.nn.Module, batch: TrainBatch, first: torch.Tensor, inverse: torch.Tensor):
        P = batch.prompt_length
        out = model(
            input_ids=batch.input_ids[first, :P], attention_mask=batch.attention_mask[first, :P],
            position_ids=batch.position_ids[first, :P], use_cache=True, logits_to_keep=1,
        )
        cache = out.past_key_values
        if hasattr(cache, "layers"):  # (G, kv_heads, P, head_dim) per layer
            self.kv = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # transformers before the per-layer cache objects
            self.kv = list(zip(cache.key_cache, cache.value_cache))
        self.last_logits = out.logits  # (G, 1, V): the last prompt column predicts response token 0
        self.inverse = inverse.to(batch.input_ids.device)

    def logits(self, model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor, width: int) -> torch.Tensor:
        """(len(rows), width, V) for response tokens 0..width-1 of ``rows``."""
        from transformers import DynamicCache

        P = batch.prompt_length
        prompt_of = self.inverse[rows]
        first = self.last_logits[prompt_of]
        if width == 1:
            return first
        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.kv):
            cache.update(keys[prompt_of], values[prompt_of], index)
        rest = model(
            input_ids=batch.input_ids[rows, P : P + width - 1], attention_mask=batch.attention_mask[rows, : P + width - 1],
            position_ids=batch.position_ids[rows, P : P + width - 1], past_key_values=cache, use_cache=True,
        ).logits  # response column t predicts response token t + 1
        return torch.cat([first, rest], dim=1)


def _full_logits(model: torch.nn.Module, batch: TrainBatch, rows: torch.Tensor, width: int) -> torch.Tensor:
    """One forward of ``rows`` (prompt columns trimmed to the longest prompt among them)."""
    P = batch.prompt_length
    real = batch.attention_mask[rows, :P].any(dim=0).nonzero()
    # Keep at least one prompt column: its logits predict the first response token.
    start = min(int(real[0]) if len(real) else P - 1, P - 1) if P else 0
    cols = slice(start, P + width)
    return model(
        input_ids=batch.input_ids[rows, cols], attention_mask=batch.attention_mask[rows, cols],
        position_ids=batch.position_ids[rows, cols], use_cache=False,
        logits_to_keep=width + 1,  # the LM head never runs over the prompt, forward or backward
    ).logits[:, :width]


def activation_checkpointing(model: Any) -> bool:
    """Whether the model recomputes activations in backward (transformers 5.x names it
    ``is_activation_checkpointing``; ``is_gradient_checkpointing``, older, now warns)."""
    if hasattr(model, "get_base_model"):  # peft's LoRA wrapper forwards attributes, not the class's properties
        model = model.get_base_model()
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False

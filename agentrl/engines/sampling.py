"""Batched next-token sampling with per-row parameters, matching SGLang's conventions.

Each row of ``logits`` belongs to one request with its own temperature, top-p, top-k and random
stream. The rules follow SGLang's sampler so that the trainer, which recomputes log-probabilities
as ``log_softmax(logits / temperature)``, sees the same numbers from either engine:

* temperature 0 is greedy: the token is the argmax, its logprob is ``log_softmax(logits)``.
* otherwise the distribution is ``p = softmax(logits / temperature)``; top-k keeps the k most
  probable tokens and top-p keeps a token while the mass *before* it is <= top_p (SGLang's rule),
  and the token is drawn from the renormalised kept mass.
* the reported logprob is ``log p[token]``: temperature-scaled, *before* the top-k / top-p filters
  (SGLang's default, i.e. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset).

A draw consumes exactly one uniform number from the row's own generator, so a seeded request
yields the same tokens whatever else is in the batch (given the same logits).
"""

from __future__ import annotations

import torch

__all__ = ["sample_next_tokens"]


def sample_next_tokens(
    logits: torch.Tensor,  # [n, vocab] float32
    temperatures: torch.Tensor,  # [n] float32, 0 = greedy
    top_ps: torch.Tensor,  # [n] float32 in (0, 1]
    top_ks: torch.Tensor,  # [n] int64, >= vocab means no filter
    uniforms: torch.Tensor,  # [n] float32 in [0, 1), ignored on greedy rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (tokens [n] int64, logprobs [n] float32) for one decoding step."""
    greedy = temperatures == 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logprobs_all = torch.log_softmax(logits / scale[:, None], dim=-1)  # [n, vocab]
    tokens = logits.argmax(dim=-1)  # greedy rows keep this; sampled rows are overwritten
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().squeeze(1)
        tokens[rows] = _draw(logprobs_all[rows].exp(), top_ps[rows], top_ks[rows], uniforms[rows])
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _draw(
    probs: torch.Tensor,  # [m, vocab]
    top_ps: torch.Tensor,  # [m]
    top_ks: torch.Tensor,  # [m]
    uniforms: torch.Tensor,  # [m]
) -> torch.Tensor:
    # A row's draw must not depend on its neighbours, so unfiltered rows always invert the CDF in
    # vocabulary order (no sort needed) and filtered rows always in descending-probability order.
    vocab = probs.shape[-1]
    filtered = (top_ps < 1.0) | (top_ks < vocab)
    tokens = _invert_cdf(probs, uniforms)
    if bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        tokens[rows] = _draw_filtered(probs[rows], top_ps[rows], top_ks[rows], uniforms[rows])
    return tokens


def _draw_filtered(probs: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [m, vocab]; ties keep argmax order
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(vocab, device=probs.device)[None, :]
    dropped = (mass_before > top_ps[:, None]) | (rank >= top_ks[:, None])
    kept = sorted_probs.masked_fill(dropped, 0.0)
    return order.gather(1, _invert_cdf(kept, uniforms)[:, None]).squeeze(1)


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]; zero-weight entries can never be chosen."""
    cdf = weights.cumsum(dim=-1)  # [m, vocab]
    target = (uniforms * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=weights.shape[-1] - 1)

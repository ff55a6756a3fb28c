"""Logits of the response tokens, with each distinct prompt run through the model once.

The n samples of a GRPO/RLOO group (and the n trajectories of one multi-turn task) share their
prompt token for token. A plain forward computes that prompt n times, forward and backward.
Here the distinct prompts go through the model once (``G`` rows instead of ``B``), keeping their
K/V with the autograd graph; the K/V are then indexed out to the ``B`` rows, and the responses
run against them. Gradients reaching a prompt's K/V from its n responses are summed by the
indexing's backward, so the result (logits and gradients) is the plain forward's up to float
rounding, at ``G·P + B·R`` tokens of compute instead of ``B·(P + R)``.

Rows share a prompt when their prompt columns and prompt attention mask are identical (in the
left-padded layout of ``batch.py`` equal prompts are padded identically), so the grouping needs
no group ids and is exact by construction.
"""

from __future__ import annotations

import torch

from agentrl.trainer.batch import TrainBatch

__all__ = ["response_logits", "distinct_prompts"]


def distinct_prompts(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: ``first[g]`` is a row holding distinct prompt g (G of them), and row b's
    prompt is ``inverse[b]``."""
    P = batch.prompt_length
    key = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(batch))
    first = torch.full((int(inverse.max()) + 1,), len(batch), dtype=torch.long).scatter_reduce_(0, inverse, rows, "amin")
    return first, inverse


def response_logits(model: torch.nn.Module, batch: TrainBatch, *, share_prompts: bool = True) -> torch.Tensor:
    """(B, R, V) logits at the positions that predict each response token (column ``P - 1 + t``
    predicts response token t)."""
    P, R = batch.prompt_length, batch.response_length
    if share_prompts and P > 0:
        first, inverse = distinct_prompts(batch)
        if len(first) < len(batch):
            return _shared_prompt_logits(model, batch, first, inverse)
    return model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False,
        logits_to_keep=R + 1,  # the LM head never runs over the prompt, forward or backward
    ).logits[:, :R]


def _shared_prompt_logits(model: torch.nn.Module, batch: TrainBatch, first: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    P, R = batch.prompt_length, batch.response_length
    prompt = model(
        input_ids=batch.input_ids[first, :P], attention_mask=batch.attention_mask[first, :P],
        position_ids=batch.position_ids[first, :P], use_cache=True, logits_to_keep=1,
    )
    cache = prompt.past_key_values
    cache.reorder_cache(inverse.to(batch.input_ids.device))  # (G, ...) -> (B, ...), differentiable
    first_logits = prompt.logits[inverse]  # (B, 1, V): the last prompt column predicts response token 0
    if R == 1:
        return first_logits
    rest = model(
        input_ids=batch.input_ids[:, P : P + R - 1], attention_mask=batch.attention_mask[:, : P + R - 1],
        position_ids=batch.position_ids[:, P : P + R - 1], past_key_values=cache, use_cache=True,
    ).logits  # (B, R - 1, V): response column t predicts response token t + 1
    return torch.cat([first_logits, rest], dim=1)

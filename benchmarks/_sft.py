"""The benchmarks' warm starts: plain supervised steps on tokenized conversations, in this process."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["supervised"]


def supervised(model: Any, examples: Sequence[tuple[list[int], list[int]]], *, pad_token_id: int, batch_size: int,
               lr: float, epochs: int, seed: int, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
    """AdamW on the mean token loss of the responses (``agentrl.trainer.sft``'s batches); returns ``model``."""
    import torch

    from agentrl.trainer.sft import sft_batches
    from agentrl.trainer.prefix import response_logprobs

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas)
    model.train()
    for batch in sft_batches(examples, batch_size=batch_size, pad_token_id=pad_token_id, epochs=epochs, seed=seed):
        logprobs, _ = response_logprobs(model, batch)
        loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model

"""Shared by the engine-versus-trainer logprob agreement tests (``tests/trainer/test_logprob_agreement.py``
on the tiny Qwen2, ``tests/agent/test_family_logprobs.py`` on the families' architectures): a model
made sharp, the engine's samples on either forward path, the trainer's logprobs of them on either
path, and their gap."""

from __future__ import annotations

import asyncio

import torch

import agentrl.engines._packed as engine_packed
import agentrl.trainer.packed as trainer_packed
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.prefix import response_logprobs


def sharpen(model: torch.nn.Module, seed: int = 1) -> None:
    """N(0, 0.1) matrices, norms near 1 and small random biases: a distribution far from uniform
    that every layer and each position change (with the default 0.02 initialisation a skipped
    layer moves a logprob by less than 1e-3)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


def engine_samples(model_dir, prompts, temperature: float, *, max_new_tokens: int, module_path: bool = False, monkeypatch=None,
                   decode_graphs: bool | None = None):
    """The built-in engine's results for ``prompts`` (seeded per prompt), on its packed decoder or,
    with ``module_path``, on the model's own forward; ``decode_graphs=True``: decode steps on the
    static layout (the CUDA-graph path, run eagerly on the CPU)."""
    if module_path:
        monkeypatch.setattr(engine_packed, "fast_decoder_supported", lambda decoder: False)

    async def run():
        async with BuiltinEngine(model_dir, max_batch_size=8, decode_graphs=decode_graphs) as engine:
            assert isinstance(engine._scheduler.forward, engine_packed.ModuleForward) == module_path
            assert (engine._scheduler.static_decode is not None) == bool(decode_graphs and not module_path)
            requests = [GenerateRequest(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i))
                        for i, p in enumerate(prompts)]
            return await asyncio.gather(*(engine.generate(r) for r in requests))

    try:
        return asyncio.run(run())
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


def as_batch(prompts, results):
    return collate_sequences(prompts, [r.output_ids for r in results], [[1] * len(r.output_ids) for r in results],
                             pad_token_id=0, logprobs=[r.logprobs for r in results])


def trainer_logprobs(model, batch, temperature, *, module_path: bool, monkeypatch):
    """The trainer's logprobs of the batch's sampled tokens, on its packed forward or its module path."""
    if module_path:
        monkeypatch.setattr(trainer_packed, "packed_supported", lambda model, batch: False)
    try:
        assert trainer_packed.packed_supported(model, batch) != module_path
        with torch.no_grad():
            return response_logprobs(model, batch, temperature=temperature)[0]
    finally:
        monkeypatch.undo()


def mismatch(logprobs, batch) -> tuple[float, float]:
    """(max, mean) absolute gap to the engine's logprobs over the sampled tokens."""
    mask = batch.response_mask
    delta = (logprobs - batch.engine_logprobs).abs() * mask
    return float(delta.max()), float(delta.sum() / mask.sum())

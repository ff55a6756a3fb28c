"""One rank is never wrapped in FSDP2 (so the trainer's packed forward applies); in bf16 its model
passes run under autocast from ``Worker.call``, and nothing else does. Checked on the CPU with
bf16 autocast standing in for the GPU's (which docs/gpu.md measured)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig
from agentrl.trainer import packed
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.workers import ActorWorker


@pytest.fixture
def actor(tiny_model_dir):
    worker = ActorWorker(model_path=str(tiny_model_dir), config=ActorConfig(), total_steps=1,
                         rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_bf16_rank_is_unwrapped_and_computes_its_model_passes_under_autocast(actor, tmp_path):
    from torch.distributed.fsdp import FSDPModule

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (5,), generator=g).tolist()] * 4
    responses = [torch.randint(3, 200, (3 + i,), generator=g).tolist() for i in range(4)]
    batch = collate_sequences(prompts, responses, [[1] * len(r) for r in responses], pad_token_id=0)
    assert actor.autocast_dtype is None  # fp32 on the CPU: no autocast
    fp32, _ = actor.call("compute_logprobs", str(tmp_path / "stacks"), batch, 4)
    actor.autocast_dtype = torch.bfloat16  # what a one-rank GPU worker gets
    seen = []
    original = actor.compute_logprobs

    def spy(*args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return original(*args, **kwargs)

    actor.compute_logprobs = spy
    bf16, _ = actor.call("compute_logprobs", str(tmp_path / "stacks"), batch, 4)
    assert seen == [(True, torch.bfloat16)]
    assert not isinstance(actor.model, FSDPModule) and packed.packed_supported(actor.model, batch)
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())  # fp32 master weights
    mask = batch.response_mask.bool()
    difference = (bf16[mask] - fp32[mask]).abs()
    assert 0 < difference.max() < 0.1  # bf16 products: close, not equal
    # a call that runs no model pass is left alone
    counts = actor.call("parameter_counts", str(tmp_path / "stacks"))
    assert counts["actor/parameters"] > 0 and not torch.is_autocast_enabled("cpu")

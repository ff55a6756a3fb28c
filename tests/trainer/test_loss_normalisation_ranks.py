"""The loss normalisation across ranks with the sequence-level aggregations: FSDP2 over 2 ranks
(real gloo between Ray actors), each rank holding rows of unequal lengths and splitting them
into micro-batches, gives the gradient of 1 rank holding the whole mini-batch. The gradient norm
(measured after FSDP's reduction, before clipping) is compared; the learning rate is negligible
so the two steps start from the same weights. A micro-batch's loss scaled by the wrong share
(sequences instead of 1 for seq-mean-token-sum-norm, a rank's own count instead of the
mini-batch's) moves the norm by tens of percent; the 1- and 2-rank forwards differ by rounding."""

from __future__ import annotations

import pytest
import torch

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import WorkerGroup
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker

pytestmark = pytest.mark.ray


def batch_of_unequal_rows():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (3,), generator=g).tolist() for _ in range(6)]
    lengths = [2, 7, 3, 5, 1, 6]  # rank 0 gets rows 0-2 (12 tokens), rank 1 rows 3-5 (12 tokens, other split)
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    masks = [[1] * n for n in lengths]
    masks[1][2:4] = [0, 0]  # observations inside a response
    masks[5][1] = 0
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    old = torch.full_like(advantages, -5.0) + torch.randn(advantages.shape, generator=g) * 0.1
    return batch.replace(advantages=advantages, old_logprobs=old)


CASES = {
    "sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16),
    "gspo": dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2),
}


def grad_norms(tiny_model_dir, batch, world_size: int) -> dict[str, float]:
    out = {}
    for name, fields in CASES.items():
        config = ActorConfig(optim=OptimConfig(lr=1e-12), ppo_micro_batch_size_per_gpu=2, **fields)
        group = WorkerGroup(
            ActorWorker, world_size=world_size, num_cpus=1 / world_size, env=worker_env(1), name="actor",
            model_path=str(tiny_model_dir), config=config, total_steps=10, device="cpu", seed=0,
        )
        try:
            denominator = mini_batch_denominator(batch.response_mask, config.loss_agg_mode)
            shards = [[batch.shard(rank, world_size)] for rank in range(world_size)]
            results = group.call_sharded("update", shards, [denominator], use_kl_loss=False)
            assert len({r["actor/grad_norm"] for r in results}) == 1  # every rank sees the reduced gradient
            out[name] = results[0]["actor/grad_norm"]
        finally:
            group.kill()
    return out


def test_two_ranks_give_the_gradient_of_one_for_the_sequence_level_aggregations(tiny_model_dir):
    import ray

    batch = batch_of_unequal_rows()
    assert [len(batch.shard(r, 2)) for r in range(2)] == [3, 3]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        one = grad_norms(tiny_model_dir, batch, 1)
        two = grad_norms(tiny_model_dir, batch, 2)
    finally:
        ray.shutdown()
    for name in CASES:
        assert one[name] > 1e-3
        assert two[name] == pytest.approx(one[name], rel=1e-4), name

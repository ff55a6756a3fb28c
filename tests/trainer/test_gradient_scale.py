"""The loss and the gradient norm (before clipping) of one step do not depend on how the
mini-batch is cut: one rank or two (real gloo between Ray actors, shards of unequal token
counts), one micro-batch or several of unequal token counts, for the actor and the critic and
every loss aggregation mode. After AdamW (the FSDP parity test) a gradient scaled by 2 (a rank's
share counted twice, a micro-batch's mean not reweighted by its tokens) looks the same; here it
moves the norm by a factor of 2.

The learning rate is 1e-12, so the steps taken in turn on one group see the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, CriticConfig, OptimConfig
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.workers import ActorWorker, CriticWorker, WorkerGroup, mini_batch_denominator, worker_env

pytestmark = pytest.mark.ray

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
OPTIM = OptimConfig(lr=1e-12, grad_clip=1e9)
# rows 0-3 hold 17 response tokens, rows 4-5 hold 3: unequal micro-batches and shards
SHARDS = [[0, 1, 2, 3], [4, 5]]


def batch_of_unequal_rows() -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    lengths = [6, 5, 4, 2, 1, 2]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    masks = [[1] * n for n in lengths]
    masks[0][2] = 0  # an observed token
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    mask = batch.response_mask
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 2.0, -2.0]).unsqueeze(1) * mask
    returns = torch.randn(mask.shape, generator=g) * mask
    values = torch.randn(mask.shape, generator=g) * 0.05 * mask
    return batch.replace(advantages=advantages, returns=returns, values=values,
                         old_logprobs=torch.full(mask.shape, -5.0) * mask)


def one_rank(tiny_model_dir, batch: TrainBatch) -> dict[tuple[str, str, int], dict[str, float]]:
    """(role, mode, micro-batch size) -> step metrics, on one unwrapped rank in this process."""
    port, out = free_port(), {}
    common = dict(model_path=str(tiny_model_dir), total_steps=100, rank=0, world_size=1, master_addr="127.0.0.1",
                  master_port=port, device="cpu", seed=0)
    try:
        for mode in MODES:
            actor = ActorWorker(config=ActorConfig(optim=OPTIM, loss_agg_mode=mode), **common)
            for micro in (6, 4):  # one micro-batch; 4 + 2 rows (17 and 3 tokens)
                actor.config = actor.config.model_copy(update={"ppo_micro_batch_size_per_gpu": micro})
                out["actor", mode, micro] = actor.update([batch], [mini_batch_denominator(batch.response_mask, mode)],
                                                         use_kl_loss=False)
        critic = CriticWorker(config=CriticConfig(optim=OPTIM), **common)
        for mode in MODES:
            for micro in (6, 4):
                critic.config = critic.config.model_copy(update={"ppo_micro_batch_size_per_gpu": micro})
                out["critic", mode, micro] = critic.update([batch], [mini_batch_denominator(batch.response_mask, mode)], mode)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def two_ranks(tiny_model_dir, batch: TrainBatch) -> dict[tuple[str, str], dict[str, float]]:
    """(role, mode) -> the ranks' metrics averaged as the driver does, rank 0 with 4 rows (17
    tokens) and rank 1 with 2 (3 tokens), micro-batches of 2 rows."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    shards = [[batch.select(rows)] for rows in SHARDS]
    common = dict(world_size=2, num_cpus=0.1, env=worker_env(1), model_path=str(tiny_model_dir), total_steps=100,
                  device="cpu", seed=0, collective_timeout_s=120.0)
    out = {}

    def mean(results: list[dict[str, float]]) -> dict[str, float]:
        return {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    try:
        critic = WorkerGroup(CriticWorker, name="critic", config=CriticConfig(optim=OPTIM, ppo_micro_batch_size_per_gpu=2), **common)
        for mode in MODES:
            out["critic", mode] = mean(critic.call_sharded("update", shards, [mini_batch_denominator(batch.response_mask, mode)], mode))
        critic.kill()
        mode = "seq-mean-token-sum"  # the actor's mode is its config's: one group, one mode
        actor = WorkerGroup(ActorWorker, name="actor", config=ActorConfig(optim=OPTIM, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=2), **common)
        out["actor", mode] = mean(actor.call_sharded("update", shards, [mini_batch_denominator(batch.response_mask, mode)], use_kl_loss=False))
        actor.kill()
    finally:
        ray.shutdown()
    return out


@pytest.mark.timeout(480)
def test_loss_and_gradient_norm_do_not_depend_on_ranks_or_micro_batches(tiny_model_dir):
    batch = batch_of_unequal_rows()
    one = one_rank(tiny_model_dir, batch)
    two = two_ranks(tiny_model_dir, batch)
    for role in ("actor", "critic"):
        for mode in MODES:
            whole, split = one[role, mode, 6], one[role, mode, 4]
            assert whole[f"{role}/grad_norm"] > 1e-3, (role, mode)  # a gradient to compare
            assert split[f"{role}/loss"] == pytest.approx(whole[f"{role}/loss"], rel=1e-5, abs=1e-7), (role, mode)
            assert split[f"{role}/grad_norm"] == pytest.approx(whole[f"{role}/grad_norm"], rel=1e-5), (role, mode)
            if (role, mode) in two:
                ranks = two[role, mode]
                assert ranks[f"{role}/loss"] == pytest.approx(whole[f"{role}/loss"], rel=1e-5, abs=1e-7), (role, mode)
                assert ranks[f"{role}/grad_norm"] == pytest.approx(whole[f"{role}/grad_norm"], rel=1e-5), (role, mode)
    # the modes weigh the rows differently (else the test could not tell them apart)
    assert len({round(one["actor", mode, 6]["actor/loss"], 6) for mode in MODES}) == 3

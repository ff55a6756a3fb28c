"""One step does not depend on how the mini-batch is cut: one rank or two (real gloo between Ray
actors, shards of unequal token counts), one micro-batch or several of unequal token counts, for
the actor (PPO's clipped loss, as GRPO uses it) and the critic, in every loss aggregation mode.
Compared: the loss, the gradient norm before clipping, and the parameters after one plain-SGD
step (``optim.optimizer=SGD``: the step is exactly -lr times the gradient, where AdamW's first
step would normalise a wrongly scaled gradient away). A rank's share counted twice or a
micro-batch's mean not reweighted by its tokens moves all three by a factor of 2."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, CriticConfig, OptimConfig
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.checkpoint_io import read_state
from agentrl.trainer.dist import free_port
from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import WorkerGroup
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker, CriticWorker

pytestmark = pytest.mark.ray

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OPTIM = OptimConfig(optimizer="SGD", lr=0.5, grad_clip=1e9)
NORM = 8  # seq-mean-token-sum-norm's constant (loss_scale_factor)
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


def actor_config(mode: str, micro: int) -> ActorConfig:
    return ActorConfig(optim=OPTIM, loss_agg_mode=mode, loss_scale_factor=NORM, ppo_micro_batch_size_per_gpu=micro)


def critic_config(micro: int) -> CriticConfig:
    return CriticConfig(optim=OPTIM, loss_scale_factor=NORM, ppo_micro_batch_size_per_gpu=micro)


def saved_model(save, role: str) -> dict[str, torch.Tensor]:
    """The full model state a (group of) worker(s) writes to a checkpoint."""
    with tempfile.TemporaryDirectory() as directory:
        save(directory)
        return read_state(directory, role)["model"]


def one_rank(tiny_model_dir, batch: TrainBatch) -> dict[tuple, tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """(role, mode, micro-batch size) -> (step metrics, model after the step), each from a fresh
    unwrapped rank in this process; ("initial", role) -> the model before any step."""
    common = dict(model_path=str(tiny_model_dir), total_steps=100, rank=0, world_size=1, master_addr="127.0.0.1",
                  master_port=free_port(), device="cpu", seed=0)
    out: dict[tuple, tuple] = {}
    try:
        for mode in MODES:
            for micro in (6, 4):  # one micro-batch; 4 + 2 rows (17 and 3 tokens)
                actor = ActorWorker(config=actor_config(mode, micro), **common)
                if not out:
                    out["initial", "actor"] = ({}, saved_model(actor.save, "actor"))
                metrics = actor.update([batch], [mini_batch_denominator(batch.response_mask, mode)], use_kl_loss=False)
                out["actor", mode, micro] = (metrics, saved_model(actor.save, "actor"))
                critic = CriticWorker(config=critic_config(micro), **common)
                if ("initial", "critic") not in out:
                    out["initial", "critic"] = ({}, saved_model(critic.save, "critic"))
                metrics = critic.update([batch], [mini_batch_denominator(batch.response_mask, mode)], mode)
                out["critic", mode, micro] = (metrics, saved_model(critic.save, "critic"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def two_ranks(tiny_model_dir, batch: TrainBatch) -> dict[tuple, tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """(role, mode) -> (the ranks' metrics averaged as the driver does, model after the step):
    rank 0 with 4 rows (17 tokens), rank 1 with 2 (3 tokens), micro-batches of 2 rows. One actor
    group per mode (the mode is the actor's config), started together; one critic group, set
    back to its first state between the modes."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    shards = [[batch.select(rows)] for rows in SHARDS]
    common = dict(world_size=2, num_cpus=0.1, env=worker_env(1), model_path=str(tiny_model_dir), total_steps=100,
                  device="cpu", seed=0, collective_timeout_s=120.0)

    def mean(results: list[dict[str, float]]) -> dict[str, float]:
        return {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    out = {}
    try:
        actors = {mode: WorkerGroup(ActorWorker, name=f"actor-{mode}", config=actor_config(mode, 2), wait=False, **common)
                  for mode in MODES}
        critic = WorkerGroup(CriticWorker, name="critic", config=critic_config(2), **common)
        with tempfile.TemporaryDirectory() as first:
            critic.call_all("save", first)
            for mode in MODES:
                metrics = mean(critic.call_sharded("update", shards, [mini_batch_denominator(batch.response_mask, mode)], mode))
                out["critic", mode] = (metrics, saved_model(lambda d: critic.call_all("save", d), "critic"))
                critic.call_all("load", first)
        critic.kill()
        for mode, actor in actors.items():
            metrics = mean(actor.call_sharded("update", shards, [mini_batch_denominator(batch.response_mask, mode)], use_kl_loss=False))
            out["actor", mode] = (metrics, saved_model(lambda d: actor.call_all("save", d), "actor"))
            actor.kill()
    finally:
        ray.shutdown()
    return out


def assert_same_step(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], what) -> None:
    """The two steps moved every parameter by the same amount (at 1e-5 of the largest move)."""
    assert a.keys() == b.keys() == initial.keys(), what
    moves = {k: (a[k] - initial[k], b[k] - initial[k]) for k in initial}
    largest = max(float(da.abs().max()) for da, _ in moves.values())
    assert largest > 1e-4, what  # the step moved something
    worst = max(float((da - db).abs().max()) for da, db in moves.values())
    assert worst <= 1e-5 * largest, (what, worst, largest)


@pytest.mark.timeout(480)
def test_loss_gradient_norm_and_sgd_step_do_not_depend_on_ranks_or_micro_batches(tiny_model_dir):
    batch = batch_of_unequal_rows()
    one = one_rank(tiny_model_dir, batch)
    two = two_ranks(tiny_model_dir, batch)
    for role in ("actor", "critic"):
        initial = one["initial", role][1]
        for mode in MODES:
            (whole, whole_model), (split, split_model) = one[role, mode, 6], one[role, mode, 4]
            (ranks, ranks_model) = two[role, mode]
            assert whole[f"{role}/grad_norm"] > 1e-3, (role, mode)  # a gradient to compare
            for other, model, how in ((split, split_model, "micro-batches"), (ranks, ranks_model, "2 ranks")):
                assert other[f"{role}/loss"] == pytest.approx(whole[f"{role}/loss"], rel=1e-5, abs=1e-7), (role, mode, how)
                assert other[f"{role}/grad_norm"] == pytest.approx(whole[f"{role}/grad_norm"], rel=1e-5), (role, mode, how)
                assert_same_step(whole_model, model, initial, (role, mode, how))
    # the modes weigh the rows differently (else the test could not tell them apart)
    assert len({round(one["actor", mode, 6][0]["actor/loss"], 6) for mode in MODES}) == 4
    assert len({round(one["critic", mode, 6][0]["critic/loss"], 6) for mode in MODES}) == 4

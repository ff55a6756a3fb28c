"""The actor's update with each policy loss, aggregation mode and rollout correction: the real
tiny model under FSDP2 on a 1-rank gloo group in this process.

The gradient of a mini-batch must not depend on how it is cut into micro-batches (the workers
scale each micro-batch's loss by ``_loss_scale``): one micro-batch of 6 rows and micro-batches
of 4 + 2 rows give the same gradient norm. The learning rate is negligible so that every update
starts from the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, OptimConfig, RolloutCorrectionConfig
from agentrl.trainer.algorithms.losses import policy_loss
from agentrl.trainer.algorithms.recipes import rollout_correction_weights
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    worker = ActorWorker(
        model_path=str(tiny_model_dir), config=ActorConfig(optim=OptimConfig(lr=1e-12)), total_steps=100,
        temperature=1.0, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0,
    )
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


def make_batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(3, 200, (2 + (i * 3) % 5,), generator=g).tolist() for i in range(6)]
    masks = [[1] * len(r) for r in responses]
    masks[2][1] = 0  # an observed token inside a response
    masks[4][0] = 0
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    mask = batch.response_mask
    return batch.replace(advantages=torch.randn(mask.shape, generator=g) * mask)


def with_logprobs(actor, batch, seed: int = 2):
    """The trainer's old logprobs, and engine logprobs off by N(0, .8) per token (a gap that
    rollout correction truncates on some tokens)."""
    old, _ = actor.compute_logprobs(batch, 6)
    noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(seed)) * 0.8
    return batch.replace(old_logprobs=old, engine_logprobs=(old + noise) * batch.response_mask)


def configured(actor, micro: int, **fields) -> None:
    actor.config = ActorConfig(optim=OptimConfig(lr=1e-12), ppo_micro_batch_size_per_gpu=micro, ppo_mini_batch_size=6,
                               loss_scale_factor=16, **fields)


CASES = [
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", clip_ratio_high=0.28),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-sum"),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-sum-norm", entropy_coeff=0.01),
    dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    dict(policy_loss="cispo", loss_agg_mode="token-mean", clip_ratio_low=1.0, clip_ratio_high=0.28),
    dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-sum-norm",
         rollout_correction=RolloutCorrectionConfig(level="sequence", cap=2.0, outlier_threshold=50.0)),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", rollout_correction=RolloutCorrectionConfig(level="token")),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean",
         rollout_correction=RolloutCorrectionConfig(level="token", method="decoupled", cap=1.5)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) if not isinstance(v, RolloutCorrectionConfig)
                                                               else f"tis-{v.level}" for v in c.values()))
def test_gradient_is_the_same_for_one_or_two_unequal_micro_batches(actor, case):
    batch = make_batch()
    configured(actor, 6, **case)
    batch = with_logprobs(actor, batch)
    old = batch.old_logprobs
    denominator = mini_batch_denominator(batch.response_mask, case["loss_agg_mode"])
    whole = actor.update([batch], [denominator], use_kl_loss=False)
    configured(actor, 4, **case)
    split = actor.update([batch], [denominator], use_kl_loss=False)
    assert whole["actor/grad_norm"] > 1e-4
    assert split["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)
    if "rollout_correction" in case:
        assert 0 < whole["rollout_corr/corrected_fraction"] < 1
    # the reported loss is the selected policy loss of the batch (one micro-batch: no averaging)
    rc = actor.config.rollout_correction
    weights = None
    if rc.level is not None:
        weights, _ = rollout_correction_weights(old, batch.engine_logprobs, batch.response_mask, rc.level, rc.cap,
                                                     rc.outlier_threshold, rc.method)
    cfg = actor.config
    want, _ = policy_loss(
        cfg.policy_loss, old, old, batch.advantages, batch.response_mask,
        clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
        loss_agg_mode=cfg.loss_agg_mode, norm_length=16, rollout_is_weights=weights,
    )
    assert whole["actor/pg_loss"] == pytest.approx(float(want), abs=1e-5)


def test_the_policy_losses_give_different_gradients(actor):
    # the selection reaches the loss: same batch, three losses, three gradient norms (off-policy:
    # at ratio 1 PPO's and CISPO's gradients coincide)
    batch = make_batch()
    norms = []
    for case in (CASES[0], CASES[4], CASES[5]):
        configured(actor, 6, **case)
        b = with_logprobs(actor, batch)
        b = b.replace(old_logprobs=b.engine_logprobs)  # sampled by a policy .8 nats per token away
        norms.append(actor.update([b], [mini_batch_denominator(b.response_mask, case["loss_agg_mode"])],
                                  use_kl_loss=False)["actor/grad_norm"])
    assert len({round(n, 6) for n in norms}) == 3

"""The actor's update against a loss written out by hand: the real tiny model on a 1-rank gloo
group in this process, and a second copy of the same weights as a plain transformers model
that scores each row on its own (no padding, no packing, no shared prompts) and takes its
gradient with autograd.

The other gradient tests compare the trainer with itself (one rank with two, one micro-batch
with several), so a fault that moves both sides alike (every gradient halved, the PPO ratio
taken against the reference model) passes them; these compare it with an independent
computation of the whole batch's loss. The optimizer is plain SGD (``optim.optimizer=SGD``): a
step is exactly -lr times the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker

LR = 0.5
TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
KL_COEF = 0.5
# relative error (norm of the difference over the norm) that fp32 reaches between the trainer's
# batched forward and the per-row forward here
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    worker = ActorWorker(
        model_path=str(tiny_model_dir), config=configured(), total_steps=100, temperature=TEMPERATURE,
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0,
    )
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def by_hand(tiny_model_dir):
    """The same architecture as a plain transformers model; each test loads the actor's weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def configured(**fields) -> ActorConfig:
    return ActorConfig(optim=OptimConfig(optimizer="SGD", lr=LR, grad_clip=1e9), ppo_mini_batch_size=6,
                       clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, **fields)


def rows() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 3, 6, 1, 4, 2)]
    masks = [[1] * len(r) for r in responses]
    masks[0][2] = 0  # observed tokens inside responses (a tool's output): in the input, not in the loss
    masks[2][0] = 0
    masks[2][4] = 0
    return prompts, responses, masks


def hand_logprobs(model, prompts, responses, R: int) -> torch.Tensor:
    """(B, R) log softmax(logits / T) of each response token, one unpadded row at a time."""
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1]  # (r, V)
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        out.append(torch.nn.functional.pad(logp, (0, R - len(response))))
    return torch.stack(out)  # (B, R)


def hand_ppo_token_losses(logp, old, adv) -> torch.Tensor:  # all (B, R)
    ratio = torch.exp(logp - old)
    pessimistic = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    return torch.where(adv < 0, torch.minimum(pessimistic, -adv * CLIP_C), pessimistic)


def token_mean(x, mask) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def seq_mean_token_mean(x, mask) -> torch.Tensor:
    return ((x * mask).sum(-1) / mask.sum(-1)).mean()


def load_actor_weights(model, actor) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def actor_gradients(actor) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in actor.model.named_parameters()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    diff = sum(float((got[k] - want[k]).square().sum()) for k in want)
    norm = sum(float(want[k].square().sum()) for k in want)
    return (diff / norm) ** 0.5


def test_the_ratio_is_taken_against_the_old_logprobs_and_the_kl_against_the_reference(actor, by_hand):
    # old (the sampling policy) and ref (the frozen start) are both away from the current policy,
    # and from each other: a ratio against ref gives another loss and another gradient
    prompts, responses, masks = rows()
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    mask = batch.response_mask  # (B, R)
    g = torch.Generator().manual_seed(5)
    actor.config = configured(ppo_micro_batch_size_per_gpu=6, loss_agg_mode="token-mean", use_kl_loss=True,
                              kl_loss_coef=KL_COEF, kl_loss_type="low_var_kl")
    current, _ = actor.compute_logprobs(batch, 6)
    old = (current + torch.randn(mask.shape, generator=g) * 0.3) * mask
    ref = (current + torch.randn(mask.shape, generator=g) * 0.3 - 0.6) * mask  # the policy has moved up
    adv = torch.tensor([1.0, -1.5, 0.5, 2.0, -0.75, -2.0]).unsqueeze(1) * mask
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref, advantages=adv)

    params = load_actor_weights(by_hand, actor)
    logp = hand_logprobs(by_hand, prompts, responses, batch.response_length)
    pg = token_mean(hand_ppo_token_losses(logp, old, adv), mask)
    log_ratio = ref - logp
    kl = token_mean(torch.exp(log_ratio) - log_ratio - 1, mask)  # k3: KL(policy || reference)
    (pg + KL_COEF * kl).backward()
    want = {k: p.grad for k, p in params.items()}
    pg_against_ref = token_mean(hand_ppo_token_losses(logp.detach(), ref, adv), mask)
    assert abs(float(pg_against_ref) - float(pg.detach())) > 0.05  # the two choices are far apart here

    metrics = actor.update([batch], [mini_batch_denominator(mask, "token-mean")], use_kl_loss=True)
    assert metrics["actor/pg_loss"] == pytest.approx(float(pg), rel=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(float(kl), rel=1e-5)
    assert relative_error(actor_gradients(actor), want) < REL_TOL


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_step_is_minus_lr_times_the_gradient_of_the_whole_batchs_loss(actor, by_hand, mode):
    # three micro-batches of unequal token counts (2 + 2 + 2 rows): each scaled to its share of
    # the whole batch's loss, which the hand computation takes at once
    prompts, responses, masks = rows()
    batch: TrainBatch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    mask = batch.response_mask
    actor.config = configured(ppo_micro_batch_size_per_gpu=2, loss_agg_mode=mode, entropy_coeff=0.05)
    current, _ = actor.compute_logprobs(batch, 6)
    old = (current + torch.randn(mask.shape, generator=torch.Generator().manual_seed(7)) * 0.3) * mask
    adv = torch.tensor([0.5, -1.0, 1.5, -0.25, 1.0, -2.0]).unsqueeze(1) * mask
    batch = batch.replace(old_logprobs=old, advantages=adv)
    aggregate = token_mean if mode == "token-mean" else seq_mean_token_mean

    params = load_actor_weights(by_hand, actor)
    before = {k: p.detach().clone() for k, p in params.items()}
    logp = hand_logprobs(by_hand, prompts, responses, batch.response_length)
    entropy = []
    for prompt, response in zip(prompts, responses):
        logits = by_hand(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
        lsm = torch.log_softmax(logits / TEMPERATURE, dim=-1)  # (r, V)
        ent = -(lsm.exp() * lsm).sum(-1)
        entropy.append(torch.nn.functional.pad(ent, (0, batch.response_length - len(response))))
    loss = aggregate(hand_ppo_token_losses(logp, old, adv), mask) - 0.05 * aggregate(torch.stack(entropy), mask)
    loss.backward()
    want = {k: p.grad for k, p in params.items()}

    metrics = actor.update([batch], [mini_batch_denominator(mask, mode)], use_kl_loss=False)
    got = actor_gradients(actor)
    assert relative_error(got, want) < REL_TOL
    norm = sum(float(w.square().sum()) for w in want.values()) ** 0.5
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=REL_TOL)
    assert metrics["actor/loss"] == pytest.approx(float(loss), rel=1e-5)
    after = {k: v for k, v in actor.model.named_parameters()}
    step = {k: (after[k].detach() - before[k]) for k in before}
    assert relative_error(step, {k: -LR * w for k, w in want.items()}) < REL_TOL

"""agentrl's GRPO update and TRL's ``GRPOTrainer`` (``loss_type="dapo"``, the calculator race's
settings) compute the same gradient from one batch.

The race against TRL (``agentrl bench trainer --task calculator``, docs/learning.md) compares
held-out reward after the same samples; a difference in what either side learns from one batch
(loss aggregation, advantages, which tokens count, the tool tokens masked out) would show there
only as a few points over several seeds. Here one fixed batch of multi-turn samples, tool results
inside the responses masked out, goes through TRL's ``compute_loss`` and through agentrl's actor
update (one rank in this process, SGD at learning rate 1 without clipping: its step is the
gradient), each with its own GRPO advantages of the same rewards. TRL's config is the race's own
(``agentrl_benchmarks.trainer.trl_config``), in fp32: TRL's default ``bf16=True`` runs its loss's
forward under the CPU's bf16 autocast, off the exact gradient (docs/learning.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.algorithms.advantages import compute_grpo_advantages
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker

pytest.importorskip("trl")

GROUP = 4
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # two groups of four, both with a signal


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 300, (4 + (i // GROUP),), generator=g).tolist() for i in range(len(REWARDS))]
    for i in range(1, len(prompts)):  # one prompt per group
        if i % GROUP:
            prompts[i] = prompts[i - 1]
    responses = [torch.randint(5, 300, (6 + i % 3,), generator=g).tolist() for i in range(len(REWARDS))]
    masks = [[1] * len(r) for r in responses]
    for i in (0, 3, 5):  # a tool's result inside the response: in the context, not in the loss
        masks[i][2:4] = [0, 0]
    return prompts, responses, masks


def _trl_gradient(model_dir, out_dir, prompts, responses, masks, **config_change) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from agentrl_benchmarks.trainer import Settings, trl_config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    race = Settings(task="calculator", prompts=len(REWARDS) // GROUP, n=GROUP, max_new_tokens=16, lr=1e-4, steps=1)
    config = trl_config(race, out_dir, **config_change)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 2), processing_class=tokenizer)
    pad = tokenizer.pad_token_id
    width_p, width_c = max(map(len, prompts)), max(map(len, responses))
    rewards = torch.tensor(REWARDS).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()  # TRL's "group"
    inputs = {
        "prompt_ids": torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([r + [pad] * (width_c - len(r)) for r in responses]),
        "completion_mask": torch.tensor([[1] * len(r) + [0] * (width_c - len(r)) for r in responses]),
        "tool_mask": torch.tensor([m + [1] * (width_c - len(m)) for m in masks]),
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(sum(map(sum, masks))),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    trainer.compute_loss(trainer.model, inputs).backward()
    return {n: p.grad.detach().double() for n, p in trainer.model.named_parameters()}, advantages


def _agentrl_gradient(model_dir, prompts, responses, masks, loss_agg_mode: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    advantages = compute_grpo_advantages(torch.tensor(REWARDS), torch.arange(len(REWARDS)) // GROUP)
    actor = ActorWorker(
        model_path=str(model_dir), total_steps=1, temperature=1.0, rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), device="cpu", seed=0,
        config=ActorConfig(optim=OptimConfig(optimizer="SGD", lr=1.0, grad_clip=1e9), ppo_mini_batch_size=len(REWARDS),
                           ppo_micro_batch_size_per_gpu=len(REWARDS), loss_agg_mode=loss_agg_mode,
                           clip_ratio_low=0.2, clip_ratio_high=0.2),
    )
    try:
        batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
        mask = batch.response_mask
        old, _ = actor.compute_logprobs(batch, len(REWARDS))
        batch = batch.replace(old_logprobs=old, advantages=advantages[:, None] * mask)
        actor.update([batch], [mini_batch_denominator(mask, loss_agg_mode)], use_kl_loss=False)
        return {n: p.grad.detach().double() for n, p in actor.model.named_parameters()}, advantages
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _flat(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in names])


@pytest.fixture(scope="module")
def trl_side(tiny_model_dir, tmp_path_factory):
    return _trl_gradient(tiny_model_dir, tmp_path_factory.mktemp("trl"), *_batch())


def test_agentrl_token_mean_update_is_trls_dapo_update_on_one_batch(tiny_model_dir, trl_side):
    trl_grads, trl_advantages = trl_side
    ours, advantages = _agentrl_gradient(tiny_model_dir, *_batch(), "token-mean")
    assert set(ours) == set(trl_grads)
    names = sorted(ours)
    a, b = _flat(trl_grads, names), _flat(ours, names)
    # the advantages differ only by the std's epsilon (TRL 1e-4, agentrl 1e-6)
    assert advantages.tolist() == pytest.approx(trl_advantages.tolist(), abs=1e-3)
    assert float((a - b).norm() / a.norm()) < 1e-3


def test_a_per_sequence_mean_is_told_apart_from_trls_update(tiny_model_dir, trl_side):
    """The check above can fail: weighting each sequence alike (rather than each token) moves the
    update away from TRL's."""
    trl_grads, _ = trl_side
    ours, _ = _agentrl_gradient(tiny_model_dir, *_batch(), "seq-mean-token-mean")
    names = sorted(ours)
    a, b = _flat(trl_grads, names), _flat(ours, names)
    assert float((a - b).norm() / a.norm()) > 1e-2


def test_trls_default_bf16_is_told_apart_from_the_exact_update(tiny_model_dir, tmp_path):
    """What the race's config sets against TRL's default: with ``bf16=True`` (TRL's default, which
    the race's first probe of one batch kept) the loss's forward runs under the CPU's bf16 autocast
    and its gradient is no longer agentrl's, the exact one, within the check above."""
    trl_grads, _ = _trl_gradient(tiny_model_dir, tmp_path, *_batch(), bf16=True)
    ours, _ = _agentrl_gradient(tiny_model_dir, *_batch(), "token-mean")
    names = sorted(ours)
    a, b = _flat(trl_grads, names), _flat(ours, names)
    assert float((a - b).norm() / b.norm()) > 1e-3

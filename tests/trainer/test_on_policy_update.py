"""The on-policy shortcut (old logprobs from the update's own forward) gives the same step as a
separate old-logprob pass followed by the update. Real tiny model, FSDP2 over a 1-rank gloo group
in this process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.dist import free_port
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker


@pytest.fixture
def actors(tiny_model_dir):
    port = free_port()
    config = ActorConfig(optim=OptimConfig(lr=1e-2), ppo_micro_batch_size_per_gpu=3, ppo_mini_batch_size=6)

    def make() -> ActorWorker:
        return ActorWorker(
            model_path=str(tiny_model_dir), config=config, total_steps=4, temperature=0.8,
            rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device="cpu", seed=0,
        )

    yield make(), make()
    if dist.is_initialized():
        dist.destroy_process_group()


def batch_with_advantages():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (2 + i,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(3, 200, (1 + (i * 2) % 5,), generator=g).tolist() for i in range(6)]
    masks = [[1] * len(r) for r in responses]
    masks[2][0] = 0  # an observed token inside a response
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    return batch.replace(advantages=torch.linspace(-1, 1, 6).unsqueeze(1) * batch.response_mask)


def test_on_policy_update_equals_old_logprob_pass_then_update(actors):
    two_pass, one_pass = actors
    batch = batch_with_advantages()
    denominator = mini_batch_denominator(batch.response_mask, "token-mean")

    old, entropy = two_pass.compute_logprobs(batch, 3)
    expected = two_pass.update([batch.replace(old_logprobs=old)], [denominator], use_kl_loss=False)
    metrics, logprobs, entropies = one_pass.update_on_policy(batch, denominator, use_kl_loss=False)

    attended = batch.response_attention_mask
    torch.testing.assert_close(logprobs, old * attended, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropies, entropy * attended, atol=1e-5, rtol=0)
    assert metrics["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], abs=1e-6)
    a, b = two_pass.full_state(), one_pass.full_state()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(two_pass.model_path).state_dict()
    assert max(float((a[k] - initial[k]).abs().max()) for k in a if k in initial) > 1e-3  # it did train

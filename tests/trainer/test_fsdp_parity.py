"""FSDP2 over 2 ranks (real gloo between Ray actors) matches 1 rank after several PPO steps.

With one rank on the CPU the module runs unwrapped (``shard_model``) and trains through the
packed forward (``packed.py``), while the FSDP2 ranks run the module forward with shared prompts
(two forward passes before one backward, which FSDP2 must reduce correctly): this also checks
that the two forms train alike. They compute the same function with sums in another order, and
Adam turns such rounding into parameter differences of up to ~1e-4 after three steps at lr 1e-3
(3e-5 measured here, 8e-5 between the two forwards in one process); a rank's gradient lost or
counted twice moves them by order lr."""

from __future__ import annotations

import pytest
import torch

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.batch import collate
from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import WorkerGroup
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker
from agentrl.trajectory import Trajectory, Turn

pytestmark = pytest.mark.ray


def synthetic_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    trajectories = []
    prompts = [torch.randint(3, vocab, (3 + 2 * k,), generator=g).tolist() for k in range(2)]
    for i in range(4):
        n = 6 + i
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [1, 1, 1, 0, 0, 1, 1, 1, 1][:n] + [1] * max(0, n - 9)
        turns, start = [], 0
        for k in range(1, n + 1):  # spans of equal mask values
            if k == n or mask[k] != mask[start]:
                turns.append(Turn("assistant" if mask[start] else "tool", start, k))
                start = k
        trajectories.append(Trajectory(
            row_id=f"r{i}", group_id=f"g{i // 2}", sample_index=i % 2, data_source="d", agent_name="x",
            prompt_ids=prompts[i // 2], response_ids=ids, response_mask=mask,
            logprobs=[0.0] * n, turns=turns, messages=[], finish_reason="stop", reward=float(i % 2),
        ))
    batch = collate(trajectories, pad_token_id=0)
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * batch.response_mask
    return batch.replace(advantages=adv, old_logprobs=torch.full_like(adv, -7.0))


def run_updates(tiny_model_dir, world_size: int, batch) -> dict[str, torch.Tensor]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=2)
        group = WorkerGroup(
            ActorWorker, world_size=world_size, num_cpus=1 / world_size, env=worker_env(1), name="actor",
            model_path=str(tiny_model_dir), config=config, total_steps=10, device="cpu", seed=0,
        )
        for _ in range(3):
            denominator = mini_batch_denominator(batch.response_mask, "token-mean")
            shards = [[batch.shard(rank, world_size)] for rank in range(world_size)]
            group.call_sharded("update", shards, [denominator], use_kl_loss=False)
        return group.call_all("full_state")[0]
    finally:
        ray.shutdown()


def test_two_ranks_match_one_rank_after_three_steps(tiny_model_dir):
    from transformers import AutoConfig

    batch = synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    one = run_updates(tiny_model_dir, 1, batch)
    two = run_updates(tiny_model_dir, 2, batch)
    assert one.keys() == two.keys()
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst < 2e-4
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max(float((one[k] - initial[k]).abs().max()) for k in one if k in initial) > 1e-3  # it did train

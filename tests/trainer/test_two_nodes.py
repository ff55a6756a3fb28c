"""Two Ray nodes (``ray.cluster_utils.Cluster`` on this machine): the ranks of a group are
placed on both (STRICT_SPREAD), meet at rank 0's node, train and checkpoint; when the second
node is lost the next call is an error naming the group (not a hang), and a group started
again from the checkpoint computes what the lost one did."""

from __future__ import annotations

import time

import pytest
import torch

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.workers import ActorWorker, WorkerDied, WorkerGroup, mini_batch_denominator, worker_env

pytestmark = pytest.mark.ray


def small_batch():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (2 + i,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, 200, (1 + 2 * i,), generator=g).tolist() for i in range(4)]
    batch = collate_sequences(prompts, responses, [[1] * len(r) for r in responses], pad_token_id=0)
    return batch.replace(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * batch.response_mask,
                         old_logprobs=torch.full(batch.response_mask.shape, -5.0) * batch.response_mask)


@pytest.mark.timeout(480)
def test_two_nodes_train_checkpoint_lose_a_node_and_resume(tiny_model_dir, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    batch = small_batch()
    shards = [batch.select([0, 3]), batch.select([1, 2])]
    common = dict(world_size=2, num_cpus=0.5, env=worker_env(1), name="actor", model_path=str(tiny_model_dir),
                  config=ActorConfig(optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=2), total_steps=4,
                  device="cpu", seed=0, collective_timeout_s=60.0)
    try:
        group = WorkerGroup(ActorWorker, placement="STRICT_SPREAD", **common)
        assert len(set(group.node_ids())) == 2  # one rank on each node
        metrics = group.call_sharded("update", [[s] for s in shards], [mini_batch_denominator(batch.response_mask, "token-mean")],
                                     use_kl_loss=False)
        assert metrics[0]["actor/grad_norm"] > 0
        trained = torch.cat([p[0] for p in group.call_sharded("compute_logprobs", shards, 2)])
        group.call_all("save", str(tmp_path / "step_1"))  # rank 0 (head node) writes: storage both nodes see

        cluster.remove_node(second)
        started = time.monotonic()
        with pytest.raises(WorkerDied, match="a worker of the actor group died"):
            group.call_sharded("compute_logprobs", shards, 2)
        assert time.monotonic() - started < 70  # an error within the collective timeout, not a hang
        group.kill()

        cluster.add_node(num_cpus=1)  # a healthy cluster again: resume from the checkpoint
        resumed = WorkerGroup(ActorWorker, placement="STRICT_SPREAD", **common)
        resumed.call_all("load", str(tmp_path / "step_1"))
        again = torch.cat([p[0] for p in resumed.call_sharded("compute_logprobs", shards, 2)])
        torch.testing.assert_close(again, trained, atol=1e-6, rtol=0)
        resumed.kill()
    finally:
        ray.shutdown()
        cluster.shutdown()

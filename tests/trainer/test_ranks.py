"""Several FSDP2 ranks (real gloo between Ray actors) whose rows need different forward calls.

Each rank's rows are chosen so that the ranks need different numbers of micro-batches and of
model calls (distinct prompts, response-length buckets, buckets of width 1 that need no call,
shards of unequal sizes): before the ranks agreed on their calls (``dist.agree_max``), such a
pass hung in FSDP2's all-gather. Every pass of every worker must finish, and the per-row results
must equal one process's on the whole batch. A short collective timeout turns a regression into
an error instead of a hung test.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.config.schema import ActorConfig, CriticConfig, OptimConfig
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.prefix import response_logprobs
from agentrl.trainer.cluster import worker_env
from agentrl.trainer.groups import WorkerGroup
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker, CriticWorker, ReferenceWorker

pytestmark = pytest.mark.ray

TIMEOUT_S = 60.0  # a rank waiting longer on the others is a hang
# Rows per rank: unequal counts; rank 0 holds two one-token responses of distinct prompts (no
# bucket call at all with shared prompts), rank 2 a single row. Three ranks only: a two-rank
# split (5 and 2 rows, run until 2026-11-27) needed no pass that this one does not (a minute of
# CI); two ranks against one are test_fsdp_parity.py's and test_ranks_run.py's.
SHARDS = {3: [[0, 3], [1, 2, 4, 6], [5]]}


def varied_batch(model) -> TrainBatch:
    """7 rows, 3 distinct prompts (2, 5 and 9 tokens; prompt A in rows 0-2 and 6), responses of
    1 to 12 tokens with observed tokens inside; row 5's response is the model's greedy
    continuation (a greedy match), the others are random."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = {k: torch.randint(3, vocab, (n,), generator=g).tolist() for k, n in (("A", 2), ("B", 5), ("C", 9))}
    prompts = [prompt[k] for k in "AAABBCA"]
    lengths = [1, 7, 3, 1, 12, 5, 2]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    with torch.no_grad():
        ids = list(prompts[5])
        for _ in range(lengths[5]):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        responses[5] = ids[len(prompts[5]):]
    masks = [[1] * n for n in lengths]
    masks[1][2:4] = [0, 0]  # a tool result inside a response
    masks[4][5:9] = [0, 0, 0, 0]
    batch = collate_sequences(prompts, responses, masks, pad_token_id=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, 1.0, -0.25]).unsqueeze(1) * batch.response_mask
    return batch.replace(advantages=advantages, returns=advantages, values=torch.zeros_like(advantages))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [3])
def test_every_pass_finishes_on_ranks_with_different_calls(tiny_model_dir, ray_session, world_size):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = varied_batch(model)
    with torch.no_grad():
        expected, expected_entropy = response_logprobs(model, batch, with_entropy=True)
    batch = batch.replace(old_logprobs=expected, ref_logprobs=expected)
    rows = SHARDS[world_size]
    shards = [batch.select(r) for r in rows]

    def gathered(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(len(batch), *parts[0].shape[1:], dtype=parts[0].dtype)
        for r, part in zip(rows, parts):
            out[r] = part
        return out

    common = dict(world_size=world_size, num_cpus=0.1, env=worker_env(1), model_path=str(tiny_model_dir),
                  device="cpu", seed=0, collective_timeout_s=TIMEOUT_S)
    config = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_micro_batch_size_per_gpu=2)
    attended = batch.response_attention_mask
    # shared prompts on the actor, every row's prompt in full on the reference
    actor = WorkerGroup(ActorWorker, name="actor", config=config, total_steps=4, share_prompts=True, **common)
    reference = WorkerGroup(ReferenceWorker, name="reference", share_prompts=False, **common)
    critic = WorkerGroup(CriticWorker, name="critic", config=CriticConfig(ppo_micro_batch_size_per_gpu=2), total_steps=4,
                         **common)
    try:
        parts = actor.call_sharded("compute_logprobs", shards, 2)
        torch.testing.assert_close(gathered([p[0] for p in parts]), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(gathered([p[1] for p in parts]), expected_entropy, atol=1e-5, rtol=0)
        ref = gathered(reference.call_sharded("compute_logprobs", shards, 2))
        torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
        assert gathered(actor.call_sharded("greedy_matches", shards, 2)).tolist() == [0, 0, 0, 0, 0, 1, 0]

        denominator = mini_batch_denominator(batch.response_mask, "token-mean")
        parts = actor.call_sharded("update_on_policy", shards, denominator, use_kl_loss=True)
        torch.testing.assert_close(gathered([p[1] for p in parts]), expected * attended, atol=1e-5, rtol=0)
        assert parts[0][0]["actor/grad_norm"] > 0
        # two mini-batches of unequal sizes per rank, then an SFT step
        minis = [batch.select([0, 1, 2, 3]), batch.select([4, 5, 6])]
        per_rank = [[mini.select([i for i in range(len(mini)) if i % world_size == r] or [0]) for mini in minis]
                    for r in range(world_size)]
        denominators = [mini_batch_denominator(m.response_mask, "token-mean") for m in minis]
        metrics = actor.call_sharded("update", per_rank, denominators, use_kl_loss=False)
        assert all(m["actor/grad_norm"] > 0 for m in metrics)
        sft = actor.call_sharded("sft_step", shards, float(batch.response_mask.sum()), 2)
        assert all(m["sft/grad_norm"] > 0 for m in sft)
        moved = gathered([p[0] for p in actor.call_sharded("compute_logprobs", shards, 2)])
        assert float((moved - expected).abs().max()) > 1e-3  # the updates trained

        assert float(gathered(critic.call_sharded("compute_values", shards, 2)).abs().max()) == 0.0  # zero head
        critic.call_sharded("update", [[s] for s in shards], [denominator], loss_agg_mode="token-mean")
        values = gathered(critic.call_sharded("compute_values", shards, 2))
        assert float(values.abs().max()) > 1e-4  # the head trained
    finally:
        for group in (actor, reference, critic):
            group.kill()

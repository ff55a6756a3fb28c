"""Replay training: truncated importance ratios from the stored logprobs; with the policy's own
logprobs stored (ratio 1) the update is the online step's. Real tiny model, FSDP2 over a 1-rank
gloo group in this process (and one run of the command through Ray)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from replay_data import SCRIPT
from torch.testing import assert_close

from agentrl.config.schema import TrainConfig
from agentrl.data.rollout_store import RolloutStore
from agentrl.replay.train import replay_step, truncated_importance_weights
from agentrl.trainer.batch import collate
from agentrl.trainer.dist import free_port
from agentrl.trainer.step import Groups, LocalGroup, TrainingStep, compute_advantages
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trainer.workers import ActorWorker


def test_importance_weights_are_the_ratios_truncated_at_max_ratio_on_sampled_tokens():
    old = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    stored = torch.tensor([[-1.0, 0.5, 0.0], [0.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weights, m = truncated_importance_weights(old, stored, mask, max_ratio=2.0)
    assert_close(weights, torch.tensor([[2.0, math.exp(-0.5), 0.0], [math.exp(-1.0), 0.0, 0.0]]))
    assert m["logprob_mismatch/mean"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m["logprob_mismatch/max"] == pytest.approx(1.0)
    assert m["replay/ratio_mean"] == pytest.approx((math.e + math.exp(-0.5) + math.exp(-1)) / 3, rel=1e-6)
    assert m["replay/ratio_max"] == pytest.approx(math.e, rel=1e-6)
    assert m["replay/truncated_fraction"] == pytest.approx(1 / 3)


CFG = TrainConfig.model_validate({
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"optim": {"lr": 1e-2}, "ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 4},
    "data": {"train_batch_size": 3},
    "rollout": {"n": 2},
})


@pytest.fixture
def actors(tiny_model_dir):
    port = free_port()

    def make() -> ActorWorker:
        return ActorWorker(model_path=str(tiny_model_dir), config=CFG.actor, total_steps=2, temperature=1.0,
                           rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device="cpu", seed=0)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def stored_with_logprobs(trajectories, logprobs: torch.Tensor, tmp_path, shift: float = 0.0):
    """The trajectories as stored by an engine whose logprobs are ``logprobs + shift``, read back."""
    stamped = []
    for i, t in enumerate(trajectories):
        lp = [float(logprobs[i, j]) + shift if m else 0.0 for j, m in enumerate(t.response_mask)]
        stamped.append(dataclasses.replace(t, logprobs=lp))
    store = RolloutStore(tmp_path / f"store{shift}")
    store.write_step(0, stamped)
    return list(store.iter_trajectories())


def test_replay_update_with_the_policys_own_logprobs_equals_the_online_update(actors, rollout, sample_rows, tiny_tokenizer, tmp_path):
    online, replay, truncated = actors(), actors(), actors()
    trajectories = rollout(SCRIPT, sample_rows, n=2)
    pad = tiny_tokenizer.pad_token_id
    own, _ = online.compute_logprobs(collate(trajectories, pad_token_id=pad), 4)

    # the online step (Trainer.train_step, on-policy): collate -> advantages -> update with its own old logprobs
    batch, _ = compute_advantages(collate(trajectories, pad_token_id=pad), CFG, None)
    expected, _, _ = online.update_on_policy(batch, mini_batch_denominator(batch.response_mask, "token-mean"), use_kl_loss=False)

    got = replay_step(Groups(LocalGroup(replay)), stored_with_logprobs(trajectories, own, tmp_path), CFG,
                      pad_token_id=pad, max_ratio=2.0)
    assert got["replay/ratio_mean"] == 1.0 and got["logprob_mismatch/max"] == 0.0 and got["replay/truncated_fraction"] == 0.0
    assert got["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], abs=1e-7)
    assert got["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-5)
    a, b = online.full_state(), replay.full_state()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6

    # an engine that gave every token 1 nat less: ratio e, truncated to 2, so each token's loss counts twice
    off = replay_step(Groups(LocalGroup(truncated)), stored_with_logprobs(trajectories, own, tmp_path, shift=-1.0), CFG,
                      pad_token_id=pad, max_ratio=2.0)
    assert off["replay/truncated_fraction"] == 1.0
    assert off["logprob_mismatch/mean"] == pytest.approx(1.0, abs=1e-6)
    assert off["replay/ratio_mean"] == pytest.approx(math.e, rel=1e-5)
    assert off["actor/pg_loss"] == pytest.approx(2 * expected["actor/pg_loss"], abs=1e-6)
    assert off["actor/grad_norm"] == pytest.approx(2 * expected["actor/grad_norm"], rel=1e-4)


def test_replay_train_command_trains_each_stored_step_and_reports_the_mismatch(scripted_store, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "replay", "train", str(scripted_store.root), "--output", str(out),
         "--max-ratio", "1.5", f"model.path={tiny_model_dir}", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=2",
         "actor.ppo_micro_batch_size_per_gpu=3",
         "trainer.threads_per_worker=1", "logging.progress=false"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"run directory: {out}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["replay/source_step"]) for r in records] == [(1, 0.0), (2, 1.0)]
    for r in records:
        # the scripted engine reports -0.5 for every token; the tiny model's own logprobs are far lower
        assert r["logprob_mismatch/mean"] > 1.0 and 0.0 <= r["replay/truncated_fraction"] <= 1.0
        assert r["replay/ratio_max"] <= 1.0 or r["replay/truncated_fraction"] > 0
        assert math.isfinite(r["actor/pg_loss"]) and r["reward/mean"] == 1.0
    assert (out / "policy" / "config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source_steps"] == [0, 1] and summary["updates"] == 2 and summary["max_ratio"] == 1.5


def graded(trajectories):
    """The trajectories with sample 1 of each group judged wrong: nonzero GRPO advantages."""
    return [dataclasses.replace(t, reward=0.0) if t.sample_index == 1 else t for t in trajectories]


def two_ways(row_id, index, request):
    """SCRIPT, with sample 1 of each row ending its last turn otherwise: the two samples of a group
    differ in tokens, so their opposite advantages do not cancel in the gradient (on identical
    tokens the update is float rounding alone, which the packed forward's shared tokens shrink)."""
    text = SCRIPT[row_id][index]
    return text + " Done." if request.session_id.endswith("#1") and index == len(SCRIPT[row_id]) - 1 else text


@pytest.mark.parametrize("mini_batch", [1, 3], ids=["off-policy-minibatches", "on-policy"])
def test_the_online_step_and_the_replay_step_give_the_same_update_on_the_same_stored_batch(
        mini_batch, actors, rollout, sample_rows, tiny_tokenizer, tmp_path):
    cfg = CFG.model_copy(update={"actor": CFG.actor.model_copy(update={"ppo_mini_batch_size": mini_batch})})
    online, replay = actors(), actors()
    before = {k: v.clone() for k, v in online.full_state().items()}
    trajectories = graded(rollout(two_ways, sample_rows, n=2))
    pad = tiny_tokenizer.pad_token_id
    own, _ = online.compute_logprobs(collate(trajectories, pad_token_id=pad), 4)
    stored = stored_with_logprobs(trajectories, own, tmp_path)  # the policy's own logprobs, read back from the store

    # online as Trainer.train_step calls it (on-policy when the config allows); replay as `agentrl replay train`
    got_online = TrainingStep(cfg, Groups(LocalGroup(online)), pad_token_id=pad).online(trajectories, step=0).metrics
    got_replay = TrainingStep(cfg, Groups(LocalGroup(replay)), pad_token_id=pad).replay(stored, max_ratio=2.0).metrics

    assert got_online["timing/actor_update_s"] > 0 and ("timing/old_logprobs_s" in got_online) == (mini_batch == 1)
    assert got_online["advantages/abs_max"] > 0.5 and got_online["actor/grad_norm"] > 0
    assert got_replay["replay/ratio_mean"] == 1.0 and got_replay["replay/truncated_fraction"] == 0.0
    a, b = online.full_state(), replay.full_state()
    assert max(float((a[k] - before[k]).abs().max()) for k in a) > 5e-3  # the policy moved (Adam, lr 1e-2)
    # on-policy, online takes its old logprobs from the update's own forward, replay from a forward
    # before it: the same numbers on one rank in fp32, so the very same update either way
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert got_replay["actor/pg_loss"] == got_online["actor/pg_loss"]
    shared = [k for k in got_online if not k.startswith(("timing/", "logprob_mismatch/", "actor/"))]
    assert shared and all(got_replay[k] == got_online[k] for k in shared), [k for k in shared if got_replay[k] != got_online[k]]

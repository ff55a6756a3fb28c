"""PPO with a critic, asynchronously (issue 36 item 8): the values a step trains with are the
consuming step's critic's, recomputed then, not the critic's at the version that sampled.

The driver (trainer/async_driver.py) runs with a scripted rank 0 whose groups finish at once, so
the second step trains groups sampled at version 0 after the first step has moved the critic;
the actor and the critic are real workers on the tiny model in this process. The values and the
GAE advantages of that step are checked against a plain forward of the critic as it was when
the step began, and the GAE recursion written out by hand."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from agentrl.agent.async_rollout import FinishedGroup
from agentrl.trajectory import Trajectory, Turn

PROMPT, RESPONSE = 6, 5


def sampled_group(group_id: str, version: int, n: int) -> FinishedGroup:
    """``n`` one-turn trajectories of one row, every token sampled at ``version``; rewards differ."""
    g = torch.Generator().manual_seed(sum(map(ord, group_id)))
    members = []
    for i in range(n):
        prompt = torch.randint(10, 90, (PROMPT - i % 2,), generator=g).tolist()  # prompts of unequal length
        response = torch.randint(10, 90, (RESPONSE - i,), generator=g).tolist()
        members.append(Trajectory(
            row_id=group_id, group_id=group_id, sample_index=i, data_source="d", agent_name="single_turn",
            prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response), logprobs=[-4.0] * len(response),
            turns=[Turn("assistant", 0, len(response))], messages=[], finish_reason="stop", reward=float(i % 2),
            token_versions=[version] * len(response)))
    return FinishedGroup(group_id, version, members)


class ScriptedRank0:
    """Rank 0's rollout calls: each submitted group is sampled at its dispatch version and has
    finished by the next look."""

    def __init__(self, n: int):
        self.n, self.submitted = n, []

    def call_rank0(self, method, *args, **kwargs):
        if method == "submit_rollout":
            ids = [f"{kwargs['group_prefix']}{i}" for i in range(len(args[0]))]
            self.submitted += [(g, kwargs["version"]) for g in ids]
            return ids
        if method == "engine_stats":
            return {}
        assert method == "finished_rollouts", method
        done, self.submitted = self.submitted, []
        return [sampled_group(g, v, self.n) for g, v in done]


class RecordingStep:
    """The training step, recording the critic as each step begins and what each step trained."""

    def __init__(self, step, critic):
        self.step, self.critic = step, critic
        self.critic_at_start: list[torch.nn.Module] = []
        self.results: list[tuple[list[Trajectory], object]] = []

    def online(self, trajectories, *, step):
        self.critic_at_start.append(copy.deepcopy(self.critic.model))
        result = self.step.online(trajectories, step=step)
        self.results.append((list(trajectories), result))
        return result


def hand_values(critic: torch.nn.Module, t: Trajectory) -> torch.Tensor:
    """V(state before each response token): the value head on the unpadded sequence's hidden states."""
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    with torch.no_grad():
        hidden = critic.backbone(input_ids=ids).last_hidden_state  # (1, P + R, H)
        return critic.head(hidden)[0, len(t.prompt_ids) - 1 : len(t.prompt_ids) - 1 + len(t.response_ids), 0]  # (R,)


def hand_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    out, next_value, next_adv = [0.0] * len(values), 0.0, 0.0
    for k in reversed(range(len(values))):
        next_adv = rewards[k] + gamma * next_value - values[k] + gamma * lam * next_adv
        out[k], next_value = next_adv, values[k]
    return out


@pytest.fixture
def driver_with_real_workers(tiny_model_dir):
    from agentrl.config import load_config
    from agentrl.trainer.async_driver import AsyncDriver
    from agentrl.trainer.dist import free_port
    from agentrl.trainer.step import Groups, LocalGroup, TrainingStep
    from agentrl.trainer.workers import ActorWorker, CriticWorker

    cfg = load_config("train", [
        "algorithm=ppo", "rollout.max_staleness=1", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=0.01", "critic.optim.lr_warmup_steps=0",
        "actor.use_kl_loss=false", "actor.rollout_correction.level=token"], check_files=False)
    common = dict(model_path=str(tiny_model_dir), total_steps=4, rank=0, world_size=1, master_addr="127.0.0.1",
                  master_port=free_port(), device="cpu", seed=0)
    try:
        actor = ActorWorker(config=cfg.actor, temperature=1.0, **common)
        critic = CriticWorker(config=cfg.critic, **common)
        step = RecordingStep(TrainingStep(cfg, Groups(LocalGroup(actor), critic=LocalGroup(critic)), pad_token_id=0), critic)
        rows = iter(range(100))
        trainer = SimpleNamespace(cfg=cfg, actor=ScriptedRank0(cfg.rollout.n), weight_version=0, store=None, step=step,
                                  log=SimpleNamespace(console=print),
                                  dataset=SimpleNamespace(next_batch=lambda: [(f"row{next(rows)}", None) for _ in range(2)]))
        trainer.sync_weights = lambda version: setattr(trainer, "weight_version", version)
        trainer.health_metrics = lambda *args, **kwargs: {}  # the run's health checks are tested in test_health.py
        yield AsyncDriver(trainer), step, cfg
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_async_ppo_step_trains_with_the_values_of_the_consuming_steps_critic(driver_with_real_workers):
    driver, step, cfg = driver_with_real_workers
    first = driver.train_step(0)  # trains two of the four groups dispatched at version 0; the critic moves
    second = driver.train_step(1)  # at version 1: the other two, sampled at version 0
    assert (first["async/staleness_max"], second["async/staleness_max"]) == (0.0, 1.0)
    trajectories, result = step.results[1]
    assert {t.oldest_version for t in trajectories} == {0} and driver.trainer.weight_version == 2
    batch = result.batch
    consuming, sampling = step.critic_at_start[1], step.critic_at_start[0]  # the critic at version 1 and at 0
    gamma, lam = cfg.algorithm.gamma, cfg.algorithm.lam
    raw, expected_values = [], []
    for i, t in enumerate(trajectories):
        R = len(t.response_ids)
        values = hand_values(consuming, t)
        assert_close(batch.values[i, :R], values, rtol=1e-5, atol=1e-6)
        expected_values.append(values)
        raw.append(hand_gae([0.0] * (R - 1) + [t.reward], values.tolist(), gamma, lam))
        assert_close(batch.returns[i, :R], torch.tensor(raw[-1]) + values, rtol=1e-5, atol=1e-5)
    # the critic at the sampling version (a zero head) would have given other values
    stale = torch.cat([hand_values(sampling, t) for t in trajectories])
    assert stale.abs().max() == 0 and torch.cat(expected_values).abs().min() > 1e-3
    # the advantages: the hand GAE over those values, whitened over the batch's sampled tokens
    flat = torch.tensor([a for row in raw for a in row])
    whitened = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + 1e-8)
    got = torch.cat([batch.advantages[i, : len(t.response_ids)] for i, t in enumerate(trajectories)])
    assert_close(got, whitened, rtol=1e-4, atol=1e-5)
    assert second["critic/values_mean"] == pytest.approx(float(torch.cat(expected_values).mean()), rel=1e-5)

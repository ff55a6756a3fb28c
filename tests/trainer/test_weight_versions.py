"""One numbering of weight versions in both trainers: version k is the policy after k actor
updates (``trainer/run.py``, ``trainer/async_driver.py``), so that a step of critic warm-up, which
updates no actor, makes no version, and staleness counts updates in either mode."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from agentrl.config import load_config
from agentrl.trainer.run import Trainer, weight_version_of
from agentrl.trainer.step import StepResult


class _Actor:
    """Rank 0's calls as the synchronous step makes them: records each rollout's policy version
    and each sync's version."""

    def __init__(self):
        self.rollout_versions: list[int] = []
        self.synced: list[int] = []

    def call_rank0(self, method, *args, **kwargs):
        if method == "engine_weight_version":  # asked after each sync (trainer/health.py): the engine has it
            return self.synced[-1]
        assert method == "rollout", method
        self.rollout_versions.append(kwargs["policy_version"])
        return []

    def call_all(self, method, version):
        assert method == "sync_weights", method
        self.synced.append(version)


class _Step:
    """The training step's answer: the actor is updated from ``trainer.critic_warmup`` on, as
    ``TrainingStep.online`` decides."""

    def __init__(self, warmup: int):
        self.warmup = warmup

    def online(self, trajectories, *, step):
        batch = SimpleNamespace(attention_mask=torch.ones(2, 3))
        return StepResult(batch=batch, metrics={}, updated_actor=step >= self.warmup)


def _trainer(warmup: int) -> Trainer:
    trainer = object.__new__(Trainer)  # the step's own code, on stand-ins for the workers
    trainer.cfg = load_config("train", [f"trainer.critic_warmup={warmup}", "algorithm=ppo"], check_files=False)
    trainer.driver, trainer.store, trainer.weight_version = None, None, 0
    trainer.actor, trainer.step = _Actor(), _Step(warmup)
    trainer.health_metrics = lambda *args, **kwargs: {}  # no trajectories to measure
    return trainer


def test_the_synchronous_trainer_numbers_versions_by_actor_updates_through_critic_warmup():
    trainer = _trainer(warmup=2)
    for step in range(5):
        trainer.train_step(step, rows=[])
    # steps 1 and 2 train the critic only: the engine stays at version 0 until the first update
    assert trainer.actor.rollout_versions == [0, 0, 0, 1, 2]
    assert trainer.actor.synced == [1, 2, 3] and trainer.weight_version == 3


def test_without_warmup_the_versions_are_the_steps_as_before():
    trainer = _trainer(warmup=0)
    for step in range(3):
        trainer.train_step(step, rows=[])
    assert trainer.actor.rollout_versions == [0, 1, 2] and trainer.actor.synced == [1, 2, 3]


def test_a_checkpoint_gives_back_its_weight_version_and_an_older_one_its_updates_from_the_step():
    assert weight_version_of({"step": 5, "weight_version": 3}, critic_warmup=2) == 3
    assert weight_version_of({"step": 5}, critic_warmup=2) == 3  # written before the version was kept
    assert weight_version_of({"step": 1}, critic_warmup=2) == 0
    assert weight_version_of({"step": 4}, critic_warmup=0) == 4

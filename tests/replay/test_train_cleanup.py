"""``replay train`` stops what it started on every failure path: a group that fails to start
leaves no other group, no process group and no Ray behind (a notebook or a test session can
start the next run in the same process)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from agentrl.config.schema import TrainConfig
from agentrl.replay.train import train_from_store
from agentrl.trainer.in_process import InProcessGroup
from agentrl.trainer.workers import ActorWorker, ReferenceWorker


def config(tiny_model_dir) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"path": str(tiny_model_dir)}, "data": {"train_batch_size": 3}, "rollout": {"n": 2},
        "actor": {"ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 3, "use_kl_loss": True},
        "trainer": {"threads_per_worker": 1}, "logging": {"progress": False, "loggers": ["jsonl"]},
    })


def failing_after_the_process_group(cls, monkeypatch):
    """``cls`` joins the process group, then fails to load its model."""
    start = cls.__init__

    def init(self, *, model_path, **kwargs):
        start(self, model_path=str(model_path) + "/missing", **kwargs)

    monkeypatch.setattr(cls, "__init__", init)


def test_a_reference_group_that_fails_to_start_leaves_the_actor_group_and_process_group_behind_nothing(
        scripted_store, tiny_model_dir, tmp_path, monkeypatch):
    killed = []
    kill = InProcessGroup.kill
    monkeypatch.setattr(InProcessGroup, "kill", lambda self: (killed.append(self.name), kill(self)))
    failing_after_the_process_group(ReferenceWorker, monkeypatch)
    cfg = config(tiny_model_dir)
    assert cfg.use_reference
    with pytest.raises(OSError, match="missing"):
        train_from_store(scripted_store, cfg, tmp_path / "run")
    assert killed == ["reference", "actor"]  # the failed group cleans itself, the started one is stopped
    assert not dist.is_initialized()


def test_an_actor_group_that_fails_after_joining_the_process_group_destroys_it(scripted_store, tiny_model_dir, tmp_path, monkeypatch):
    failing_after_the_process_group(ActorWorker, monkeypatch)
    with pytest.raises(OSError, match="missing"):
        train_from_store(scripted_store, config(tiny_model_dir), tmp_path / "run")
    assert not dist.is_initialized()

"""How many torch threads a training worker gets."""

from __future__ import annotations

from agentrl.config import TrainConfig
from agentrl.trainer.cluster import threads_per_worker


def test_config_then_the_environments_bound_then_the_cores_per_rank(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = TrainConfig()
    cfg.actor.world_size = 2
    assert threads_per_worker(cfg) == 4  # the cores shared by the actor's ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # whoever started the job bounded its threads
    assert threads_per_worker(cfg) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # set but empty: no bound
    assert threads_per_worker(cfg) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cfg.trainer.threads_per_worker = 2  # the config says
    assert threads_per_worker(cfg) == 2

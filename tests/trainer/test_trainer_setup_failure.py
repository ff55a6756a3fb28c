"""A Trainer whose setup fails after Ray started leaves nothing behind in the calling process: a
second run in the same process (a notebook, a test session) must be able to start."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_a_setup_that_fails_after_ray_started_shuts_ray_down_and_raises_the_cause(tmp_path, monkeypatch):
    import ray

    import agentrl.trainer.nodes as nodes
    from agentrl.config import load_config
    from agentrl.rundir import make_run_dir
    from agentrl.trainer.logging import MetricsLogger
    from agentrl.trainer.run import Trainer

    def unwritable(paths):
        assert ray.is_initialized()  # the failure comes after Ray started
        raise PermissionError("node 10.0.0.9 cannot write the run directory")

    monkeypatch.setattr(nodes, "check_nodes_can_write", unwritable)
    cfg = load_config("train", ["sft.enable=false", "trainer.workers=ray", f"trainer.runs_root={tmp_path}", "trainer.run_name=run",
                                "logging.progress=false", "logging.loggers=[jsonl]"])
    run = make_run_dir(cfg)
    log = MetricsLogger(run.path, cfg.logging)
    try:
        with pytest.raises(PermissionError, match="cannot write the run directory"):
            Trainer(cfg, run.path, log=log)
    finally:
        log.close()
    assert not ray.is_initialized()

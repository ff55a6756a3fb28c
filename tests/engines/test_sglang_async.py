"""Asynchronous training on SGLang-protocol servers (``engine=sglang``, managed): rollouts run
through ``SGLangEngine`` while the trainer trains, weight syncs interrupt the running requests
(partial rollouts), and a server killed mid-run is restarted while its requests go to the other
server. The managed servers are `agentrl serve` (``engine.launcher=agentrl``), which speaks
SGLang's protocol in seconds on this CPU; the real SGLang server's interrupt-and-resume is
checked in test_sglang_real.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from enginetest import trainer_in_process

pytestmark = [pytest.mark.timeout(600)]


def test_asynchronous_training_is_accepted_on_sglang_and_refused_where_it_cannot_run():
    cfg = load_config("train", ["engine=sglang", "rollout.max_staleness=2", "rollout.partial=true"], check_files=False)
    assert (cfg.engine.backend, cfg.rollout.max_staleness, cfg.rollout.partial) == ("sglang", 2, True)
    with pytest.raises(ConfigError, match=r"rollout.max_staleness.*runs on engine=builtin or engine=sglang, not engine=scripted"):
        load_config("train", ["engine=scripted", "rollout.max_staleness=1"], check_files=False)


def test_a_server_killed_mid_run_is_restarted_its_requests_go_to_the_other_and_every_group_is_trained_whole(tmp_path):
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.engines.guard import auth_headers

    overrides = [
        "engine=sglang", "engine.launcher=agentrl", "engine.num_servers=2", "rollout.max_staleness=1", "rollout.partial=true",
        "actor.rollout_correction.level=token", "sft.enable=false", "data.train_batch_size=4", "rollout.n=2",
        # long generations of the untrained tiny model, one request at a time on each server (a
        # rollout then takes several times an update, whatever the engine's speed): requests are
        # running when a sync comes
        "rollout.max_new_tokens=160", 'engine.launch_args=["--max-batch-size","1"]', "data.max_response_length=256", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.optim.lr=1e-3", "reward.default=gsm8k_flexible", "reward.format_score=0.5",
        "model.tiny.skills=none", "rollout.temperature=0.7", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.export_hf=false", "logging.progress=false", "logging.loggers=[jsonl]",
        f"trainer.runs_root={tmp_path}", "trainer.run_name=run",
    ]
    trainer, run, log = trainer_in_process(overrides)
    try:
        engine = trainer.actor.worker.engine
        assert engine.partial and trainer.servers is not None and len(trainer.servers.urls) == 2
        metrics = [trainer.train_step(0, None)]
        victim = trainer.servers.servers[0]
        killed_serving: list[int] = []
        rejoined: list[tuple[int, int]] = []  # (the engine's version, the server's) when it rejoined

        def kill_while_it_serves() -> None:
            deadline = time.monotonic() + 120
            while engine.servers[0].outstanding == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            killed_serving.append(engine.servers[0].outstanding)
            os.killpg(victim.process.pid, signal.SIGKILL)
            while engine.servers[0].healthy and time.monotonic() < deadline + 60:  # taken out of rotation
                time.sleep(0.002)
            while not engine.servers[0].healthy and time.monotonic() < deadline + 300:  # back in rotation
                time.sleep(0.002)
            version = engine.weight_version  # the server's weights at that moment: at least these
            info = httpx.get(f"{victim.url}/get_model_info", headers=auth_headers(trainer.servers.api_key), timeout=30).json()
            rejoined.append((version, int(info["weight_version"])))

        killer = threading.Thread(target=kill_while_it_serves, daemon=True)
        killer.start()
        metrics += [trainer.train_step(step, None) for step in range(1, 5)]
        assert killed_serving[0] > 0  # requests were running on it
        assert not engine.servers[0].healthy or trainer.servers.servers[0] is not victim  # it was taken out
        deadline = time.monotonic() + 120
        while not engine.servers[0].healthy:  # restarted by the watchdog, probed, brought to the current weights
            assert time.monotonic() < deadline, "the restarted server never rejoined"
            metrics.append(trainer.train_step(len(metrics), None))
        killer.join()
    finally:
        trainer.close()
        log.close()
    assert trainer.servers.restarts == [1, 0]
    [(engine_version, server_version)] = rejoined
    assert engine_version > 0 and server_version >= engine_version  # brought to the current weights before it served
    for m in metrics:  # every step trains 4 whole groups of 2 within the bound; nothing failed: the requests moved
        assert m["async/staleness_hist/0"] + m["async/staleness_hist/1"] == 8 and m["async/staleness_max"] <= 1, m
        assert m["failures/rate"] == 0.0, m
        assert m["engine/resumed_requests"] <= m["engine/interrupted_requests"]
    assert sum(m["engine/interrupted_requests"] for m in metrics) > 0  # a sync interrupted running requests
    stored = list(RolloutStore(run.rollouts).iter_trajectories())
    dropped = sum(m["async/dropped_groups"] for m in metrics)  # over the bound (the kill delayed them): stored, not trained
    assert len(stored) == 8 * len(metrics) + 2 * dropped  # each trajectory stored once, none lost
    assert all(len(t.token_versions) == len(t.response_ids) for t in stored)
    # no token older than its group's dispatch: the restarted server served only once at the current weights
    assert all(v >= t.policy_version for t in stored for v in t.token_versions if v >= 0)
    assert any(len({v for v in t.token_versions if v >= 0}) > 1 for t in stored)  # resumed across a sync: two versions

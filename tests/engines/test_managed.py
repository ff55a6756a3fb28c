"""Managed servers (``engines/managed.py``, ``engines/lifeline.py``) with real processes and real HTTP:
``agentrl serve`` servers (SGLang's protocol, seconds to start) stand in for SGLang here; the
real-SGLang runs are in test_sglang_train.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from agentrl.config import load_config
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.guard import auth_headers
from agentrl.engines.launch import ServerSpec, free_port, serve_specs
from agentrl.engines.managed import ManagedServers, check_engine_config, managed_specs
from agentrl.engines.sglang import SGLangEngine
from agentrl.engines.sglang_cpu.server import CPU_FLAGS
from agentrl.errors import ConfigError, EngineUnavailable


def _pgid_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s}s for {what}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- configuration


def test_typed_flags_and_pass_through_reach_the_sglang_command_line():
    cfg = load_config("train", [
        "engine=sglang", "engine.device=cuda", "engine.num_servers=2", "engine.tp_size=2", "engine.mem_fraction_static=0.7",
        "engine.context_length=4096", "engine.attention_backend=fa3", "engine.max_total_tokens=100000",
        "engine.python=/envs/sglang/bin/python", "engine.launch_args=[--enable-metrics]",
    ])
    specs = managed_specs(cfg.engine, "/ckpt/policy")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    assert specs[0].command == [
        "/envs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/policy", "--tp-size", "2",
        "--host", "127.0.0.1", "--port", str(specs[0].port), "--api-key", specs[0].api_key,
        "--mem-fraction-static", "0.7", "--context-length", "4096", "--attention-backend", "fa3", "--enable-metrics",
        "--max-total-tokens", "100000",
    ]


def test_on_a_cpu_the_cpu_recipe_is_used_and_tensor_parallelism_refused():
    cfg = load_config("train", ["engine=sglang", "engine.device=cpu", "engine.python=/envs/sglang/bin/python",
                                "engine.launch_args=[--log-level,debug]"])
    (spec,) = managed_specs(cfg.engine, "/ckpt/policy")
    assert spec.command[0] == "/envs/sglang/bin/python"
    tail = spec.command[spec.command.index(CPU_FLAGS[0]):]
    assert tail == [*CPU_FLAGS, "--max-total-tokens", "65536", "--log-level", "debug"]
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1"
    cfg = load_config("train", ["engine=sglang", "engine.device=cpu", "engine.tp_size=2"])
    with pytest.raises(ConfigError, match=r"engine.tp_size: 2: tensor parallelism needs GPUs"):
        managed_specs(cfg.engine, "/ckpt/policy")


def test_engine_settings_a_command_cannot_honour_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"engine.weight_sync: nccl needs GPUs"):
        check_engine_config(load_config("train", ["engine=sglang", "engine.weight_sync=nccl"]), training=True)
    with pytest.raises(ConfigError, match=r"engine.weight_sync: memory: SGLang servers are other processes"):
        check_engine_config(load_config("train", ["engine=sglang", "engine.weight_sync=memory"]), training=True)
    remote = load_config("train", ["engine=sglang", "engine.servers=[http://10.0.0.7:30000,http://127.0.0.1:30000]"])
    with pytest.raises(ConfigError, match=r"engine.servers: \['http://10.0.0.7:30000'\]: agentrl train syncs weights by disk"):
        check_engine_config(remote, training=True)
    check_engine_config(remote, training=False)  # a rollout needs no weight sync
    check_engine_config(load_config("train", ["engine=sglang", "engine.servers=[http://localhost:30000]"]), training=True)


# ----------------------------------------------------------------------------- start-up


def test_a_server_that_exits_during_start_up_fails_the_start_with_its_log(tmp_path):
    port = free_port()
    crash = ServerSpec([sys.executable, "-c", "print('cannot load /nope: no config.json'); raise SystemExit(3)"], port)
    with pytest.raises(EngineUnavailable, match=r"(?s)exited with 3 during start-up.*cannot load /nope: no config.json"):
        ManagedServers([crash], ready_timeout_s=30, log_dir=tmp_path).start()


def test_a_server_never_ready_times_out_with_its_log_and_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    hang = ServerSpec([sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                       "print('loading weights...', flush=True); time.sleep(600)"], free_port())
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"(?s)not ready after .*loading weights\.\.\."):
        ManagedServers([hang], ready_timeout_s=3, log_dir=tmp_path / "logs").start()
    assert time.monotonic() - started < 30
    pid = int(pid_file.read_text())
    assert not _pgid_members(os.getpgid(pid)) if Path(f"/proc/{pid}").exists() else True
    _wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3],
                10, f"the hung server {pid} to end")


# ----------------------------------------------------------------------------- lifetime


DRIVER = textwrap.dedent("""
    import sys, time
    from agentrl.config import load_config
    from agentrl.engines.managed import ManagedServers
    cfg = load_config("rollout", ["engine=sglang", "engine.launcher=agentrl", "engine.num_servers=2",
                                  f"model.path={sys.argv[1]}"])
    servers = ManagedServers.from_config(cfg, sys.argv[1], log_dir=sys.argv[2]).start()
    print(" ".join(str(s.process.pid) for s in servers.servers), flush=True)
    time.sleep(600)
""")


def test_no_server_outlives_a_sigkilled_driver_nor_leaves_its_temp_dir(model_dir, tmp_path):
    temp = tmp_path / "tmp"  # the driver's temp dir, where each server gets a TMPDIR of its own
    temp.mkdir()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(model_dir), str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(temp)})
    try:
        line = driver.stdout.readline()
        groups = [int(p) for p in line.split()]
        assert len(groups) == 2, f"the driver printed {line!r}"
        members = {g: _pgid_members(g) for g in groups}
        assert all(len(m) >= 2 for m in members.values()), members  # the lifeline and its server, each
        assert len(list(temp.glob("agentrl-srv-*"))) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        _wait_until(lambda: not any(_pgid_members(g) for g in groups), 30, f"the servers of process groups {groups} to end")
        # nobody called ServerProcess.stop: each lifeline removed its server's temp dir on its way out
        assert list(temp.glob("agentrl-srv-*")) == []
    finally:
        driver.kill()


def test_stop_ends_every_process_of_every_server(model_dir, tmp_path):
    servers = ManagedServers(serve_specs(model_dir, num_servers=2), ready_timeout_s=120, log_dir=tmp_path).start()
    groups = [s.process.pid for s in servers.servers]
    assert all(_pgid_members(g) for g in groups)
    servers.stop()
    assert not any(_pgid_members(g) for g in groups)
    servers.stop()  # idempotent


def test_a_server_killed_mid_rollout_is_restarted_and_no_request_is_lost(model_dir, tmp_path):
    servers = ManagedServers(serve_specs(model_dir, num_servers=2), ready_timeout_s=120, log_dir=tmp_path,
                             check_interval_s=0.2).start()
    try:
        victim = servers.servers[0]

        async def run() -> list:
            engine = SGLangEngine(servers.urls, backoff_s=0.1, probe_interval_s=0.2, api_key=servers.api_key)
            sampling = SamplingParams(max_new_tokens=48, temperature=1.0, seed=3)
            requests = [GenerateRequest([1, 2, 3 + i % 5], sampling, session_id=f"s{i % 8}") for i in range(64)]
            taken_out = []

            async def kill_mid_rollout():
                while engine.servers[0].outstanding < 4:  # the victim is serving
                    await asyncio.sleep(0.01)
                os.killpg(victim.process.pid, signal.SIGKILL)
                while engine.servers[0].healthy:
                    await asyncio.sleep(0.01)
                taken_out.append(True)

            try:
                results = await asyncio.gather(*(engine.generate(r) for r in requests), kill_mid_rollout())
                assert taken_out == [True]
                # the watchdog restarts it; the engine probes it, finds it healthy, takes it back
                deadline = time.monotonic() + 120
                while not engine.servers[0].healthy:
                    assert time.monotonic() < deadline, "the restarted server never rejoined the rotation"
                    await engine.generate(requests[0])
                    await asyncio.sleep(0.2)
                return results[:-1]
            finally:
                await engine.aclose()

        results = asyncio.run(run())
        assert len(results) == 64 and all(len(r.output_ids) > 0 for r in results)
        assert servers.restarts == [1, 0]
        assert servers.servers[0] is not victim and servers.servers[0].alive()
        assert httpx.get(f"{servers.urls[0]}/health_generate", headers=auth_headers(servers.api_key), timeout=30).status_code == 200
        assert servers.servers[0].spec.api_key == servers.api_key  # the restarted server kept the launch's key
        assert (tmp_path / f"server-{victim.spec.port}.log.1").is_file()  # the dead server's log is kept
    finally:
        servers.stop()


# ----------------------------------------------------------------------------- agentrl train


@pytest.mark.ray
def test_a_rollout_that_fails_above_the_rate_stops_the_run_with_the_first_error_and_a_checkpoint(tmp_path):
    """A local external server that is not there: every request fails after failover, every
    trajectory ends with engine_error, and the run stops before any update, resumable."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "engine=sglang", f"engine.servers=[http://127.0.0.1:{port}]",
         "engine.max_retries=0", "sft.enable=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size_per_gpu=4", "trainer.val_before_train=false", "logging.progress=false",
         f"trainer.runs_root={tmp_path}", "trainer.run_name=run"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert ("agentrl train: stopped after 0 steps: step 1: 4 of 4 trajectories failed ({'engine_error': 4}), above "
            "trainer.max_failure_rate=0.5. First failure, trajectory train0/") in done.stderr
    assert f"(engine_error):\nno healthy SGLang server among ['http://127.0.0.1:{port}']: http://127.0.0.1:{port}/generate: unreachable" in done.stderr
    assert "Traceback" not in done.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_0"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # the stop, kept as a health stop is
    assert summary["steps"] == 0 and (tmp_path / "run" / "report.html").is_file()
    assert {k: summary["stopped"][k] for k in ("step", "measure", "value", "key")} == {
        "step": 0, "measure": "failures/rate", "value": 1.0, "key": "trainer.max_failure_rate"}
    assert summary["stopped"]["reason"].startswith("step 1: 4 of 4 trajectories failed")

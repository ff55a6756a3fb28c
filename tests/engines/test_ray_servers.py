"""Managed servers placed by Ray (``engine.placement=ray``, ``engines/ray_servers.py``): real Ray,
real ``agentrl serve`` processes (SGLang's protocol), real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from agentrl.config import load_config
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.guard import auth_headers
from agentrl.engines.managed import ManagedServers, check_engine_config
from agentrl.engines.ray_servers import RayServer
from agentrl.engines.sglang import SGLangEngine
from agentrl.errors import ConfigError, EngineUnavailable

pytestmark = pytest.mark.ray


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in a process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s}s for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _config(model_dir, **engine):
    overrides = ["engine=sglang", "engine.launcher=agentrl", "engine.placement=ray", "engine.ready_timeout_s=120",
                 f"model.path={model_dir}", *(f"engine.{k}={v}" for k, v in engine.items())]
    return load_config("train", overrides)


def _generate(urls: list[str], api_key: str | None) -> list[int]:
    async def run():
        engine = SGLangEngine(urls, api_key=api_key)
        try:
            sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
            return [len((await engine.generate(GenerateRequest([1, 2, 3], sampling, session_id=f"s{i}"))).output_ids) for i in range(4)]
        finally:
            await engine.aclose()

    return asyncio.run(run())


def test_servers_run_in_their_bundles_under_host_actors_and_end_with_them(local_ray, model_dir, tmp_path):
    ray = local_ray
    servers = ManagedServers.from_config(_config(model_dir, num_servers=2), model_dir, log_dir=tmp_path)
    servers.check_interval_s = 0.2
    # the host killed below cannot remove its server's temp dir (Ray SIGKILLs a killed actor's
    # children, the server's lifeline among them): the servers' temp files go to one the test removes
    server_tmp = Path(tempfile.mkdtemp(prefix="srv-"))  # short: unix socket paths are capped at 107 bytes
    servers.specs = [dataclasses.replace(spec, env={**spec.env, "TMPDIR": str(server_tmp)}) for spec in servers.specs]
    servers.start()
    try:
        node_ip = ray.util.get_node_ip_address()
        assert all(s.startswith(f"http://{node_ip}:") for s in servers.urls), servers.urls  # the node's address, not loopback
        assert len(set(servers.urls)) == 2 and servers.api_key
        table = ray.util.placement_group_table(servers.placement.group)
        assert table["state"] == "CREATED" and table["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}}
        assert _generate(servers.urls, servers.api_key) == [6, 6, 6, 6]
        assert httpx.get(f"{servers.urls[0]}/health_generate", timeout=30).status_code == 401  # the launch's key is required

        first, second = servers.servers
        assert isinstance(first, RayServer)
        host_pid = ray.get(first.host.pid.remote())
        assert _parent(first.pgid) == host_pid  # the lifeline is the host actor's child, not the driver's

        # the server process dies: its host starts it again under the same URL
        os.killpg(first.pgid, signal.SIGKILL)
        _wait_until(lambda: servers.restarts[0] == 1 and servers.servers[0] is not first and servers.servers[0].alive(), 120,
                    "the watchdog to restart server 0 on its host")
        assert servers.servers[0].url == first.url and ray.get(servers.servers[0].host.pid.remote()) == host_pid
        assert (tmp_path / f"server-{first.spec.port}.log.1").is_file()  # the dead server's log is kept

        # the host actor dies (as with a lost node): its server ends with it, a new host in the same bundle restarts it
        second_pgid, second_host_pid = second.pgid, ray.get(second.host.pid.remote())
        ray.kill(second.host)
        _wait_until(lambda: not _group_alive(second_pgid), 30, "every process of the killed host's server to end")
        _wait_until(lambda: servers.restarts[1] == 1 and servers.servers[1].alive(), 120, "server 1 to be restarted on a new host")
        assert ray.get(servers.servers[1].host.pid.remote()) != second_host_pid and servers.servers[1].url == second.url
        assert _generate(servers.urls, servers.api_key) == [6, 6, 6, 6]
    finally:
        pgids, group = [s.pgid for s in servers.servers], servers.placement.group
        servers.stop()
        shutil.rmtree(server_tmp, ignore_errors=True)
    assert not any(_group_alive(p) for p in pgids)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    servers.stop()  # idempotent


def test_a_placement_the_cluster_cannot_hold_fails_within_the_timeout_naming_what_it_asked(local_ray, model_dir, tmp_path):
    started = time.monotonic()
    with pytest.raises(EngineUnavailable) as err:
        ManagedServers.from_config(_config(model_dir, cpus_per_server=16, ready_timeout_s=3), model_dir, log_dir=tmp_path)
    assert time.monotonic() - started < 30
    message = str(err.value)
    assert "{'CPU': 16.0}" in message and "could not be placed within 3s" in message and "engine.cpus_per_server" in message
    assert not [g for g in local_ray.util.placement_group_table().values() if g["state"] in ("PENDING", "CREATED")]


def test_a_server_that_fails_to_start_on_its_host_raises_its_own_error_and_frees_the_bundles(local_ray, model_dir, tmp_path):
    servers = ManagedServers.from_config(_config(model_dir), tmp_path / "no-model", log_dir=tmp_path)
    with pytest.raises(EngineUnavailable, match=r"exited with \d+ during start-up(.|\n)*no-model"):
        servers.start()
    servers.stop()
    assert not [g for g in local_ray.util.placement_group_table().values() if g["state"] in ("PENDING", "CREATED")]


def test_placement_ray_is_refused_where_it_cannot_work(model_dir):
    with pytest.raises(ConfigError, match="engine.placement"):
        check_engine_config(_config(model_dir), training=False)  # agentrl rollout runs no Ray
    with pytest.raises(ConfigError, match="engine.placement.*engine.servers"):
        check_engine_config(load_config("train", ["engine=sglang", "engine.placement=ray", "engine.servers=[http://127.0.0.1:1]"]),
                            training=True)


def test_agentrl_train_with_ray_placed_servers(tmp_path):
    """Two GRPO steps of `agentrl train` whose servers are Ray-placed; every server ends with the run."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    args = ["engine=sglang", "engine.launcher=agentrl", "engine.placement=ray", "sft.enable=false", "data.train_batch_size=2",
            "rollout.n=2", "rollout.max_new_tokens=8", "data.max_response_length=32", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size_per_gpu=4", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
            "trainer.total_steps=2",
            "logging.progress=false", f"trainer.runs_root={tmp_path}", "trainer.run_name=run", "trainer.export_hf=false"]
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = list((tmp_path / "run" / "servers").glob("server-*.log"))
    assert len(logs) == 1 and " listening on " in logs[0].read_text()  # the server's log reached the run directory
    ports = [p.name.split("-")[1].split(".")[0].encode() for p in logs]
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"agentrl.engines.lifeline" in argv or b"agentrl.engines.serve" in argv) and any(p in argv for p in ports):
            left.append(int(cmdline.parent.name))
    assert not left, f"server processes outlived the run: {left}"

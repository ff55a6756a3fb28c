"""Fixtures for the engine tests (helpers live in enginetest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.engines.guard import new_api_key
from agentrl.engines.launch import LaunchedServers, ServerProcess, launch_servers, serve_specs
from enginetest import build_qwen2


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-a")
    build_qwen2(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    """Different weights of the same architecture, for weight-update tests."""
    path = tmp_path_factory.mktemp("qwen2-b")
    build_qwen2(seed=1).save_pretrained(path)
    return path


@pytest.fixture
def serve_factory(model_dir):
    """Start `agentrl serve` subprocesses (in parallel) on free ports, or on given ports to restart
    one; every server started is stopped at teardown. They share one API key (a restarted server
    takes its clients' key)."""
    launches: list[LaunchedServers] = []
    key = new_api_key()

    def start(count: int = 1, *, ports: list[int] | None = None, extra: tuple[str, ...] = ()) -> list[ServerProcess]:
        specs = serve_specs(model_dir, num_servers=count, ports=ports, extra_args=extra, api_key=key)
        launches.append(launch_servers(specs, ready_timeout_s=120))
        return launches[-1].servers

    yield start
    for launched in launches:
        launched.stop()  # the servers, and the temp dir of their logs


@pytest.fixture(scope="module")
def server_pair(model_dir):
    """Two `agentrl serve` processes shared by the tests of a module (tests leave them as found)."""
    servers = launch_servers(serve_specs(model_dir, num_servers=2), ready_timeout_s=120)
    yield servers.servers
    servers.stop()

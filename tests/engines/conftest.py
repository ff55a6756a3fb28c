"""Fixtures for the engine tests (helpers live in enginetest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from enginetest import ServeProcess, build_qwen2


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
    """Start `agentrl serve` processes; every one is killed at teardown."""
    started: list[ServeProcess] = []

    def start(model: Path | None = None, port: int | None = None, extra: tuple[str, ...] = ()) -> ServeProcess:
        server = ServeProcess(model or model_dir, port, extra)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()

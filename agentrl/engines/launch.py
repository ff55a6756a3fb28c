"""Start inference servers as subprocesses, wait until they generate, and stop them cleanly.

Two kinds of server speak the same protocol: SGLang (``python -m sglang.launch_server``, one per
GPU or tensor-parallel group, each pinned to its GPUs with ``CUDA_VISIBLE_DEVICES``) and
``agentrl serve`` (the built-in engine; what the tests start). Each server runs in a process
group of its own (SGLang forks scheduler and detokenizer processes), so stopping one ends all
of its processes: SIGTERM, then SIGKILL after a grace period.

    specs = sglang_specs("/ckpt/policy", num_servers=4, tp_size=2, python="/envs/sglang/bin/python")
    with launch_servers(specs) as servers:
        engine = SGLangEngine(servers.urls)

Readiness means ``GET /health_generate`` answered 200: the server ran one token through its
model, not merely opened its port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from agentrl.errors import EngineUnavailable

__all__ = ["ServerSpec", "ServerProcess", "LaunchedServers", "launch_servers", "sglang_specs", "serve_specs", "free_port"]


@dataclass(frozen=True)
class ServerSpec:
    command: list[str]
    port: int
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ServerProcess:
    """One running server (its whole process group)."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, log_path: Path):
        self.spec, self.process, self.log_path = spec, process, log_path
        self.url = spec.url

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=30.0) as client:
            while True:
                if not self.alive():
                    raise EngineUnavailable(
                        f"server {self.url} exited with {self.process.returncode} during start-up "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health_generate").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"server {self.url} not ready after {timeout_s}s (log {self.log_path}):\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group; SIGKILL what is left after ``grace_s``. Idempotent."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # children the leader left behind
        self.process.wait()

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


class LaunchedServers:
    """The servers of one launch; a context manager that stops them all."""

    def __init__(self, servers: list[ServerProcess]):
        self.servers = servers

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "LaunchedServers":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def launch_servers(specs: Sequence[ServerSpec], *, ready_timeout_s: float = 600.0, log_dir: str | Path | None = None) -> LaunchedServers:
    """Start every server, then wait for all of them; on any failure stop them all and raise."""
    log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="agentrl-servers-"))
    log_root.mkdir(parents=True, exist_ok=True)
    started: list[ServerProcess] = []
    try:
        for spec in specs:
            log_path = log_root / f"server-{spec.port}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    spec.command,
                    env={**os.environ, **spec.env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            started.append(ServerProcess(spec, process, log_path))
        deadline = time.monotonic() + ready_timeout_s
        for server in started:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for server in started:
            server.stop(grace_s=2.0)
        raise
    return LaunchedServers(started)


def sglang_specs(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    tp_size: int = 1,
    python: str | Path = sys.executable,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    gpu_offset: int = 0,
    extra_args: Sequence[str] = (),
) -> list[ServerSpec]:
    """One SGLang server per group of ``tp_size`` GPUs: server i sees GPUs i*tp .. i*tp+tp-1."""
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_servers)]
    if len(ports) != num_servers:
        raise ValueError(f"{num_servers} servers need {num_servers} ports, got {len(ports)}")
    specs = []
    for i, port in enumerate(ports):
        gpus = ",".join(str(gpu_offset + i * tp_size + j) for j in range(tp_size))
        command = [
            str(python), "-m", "sglang.launch_server",
            "--model-path", str(model_path),
            "--tp-size", str(tp_size),
            "--host", host,
            "--port", str(port),
            *extra_args,
        ]  # fmt: skip
        specs.append(ServerSpec(command, port, host, {"CUDA_VISIBLE_DEVICES": gpus}))
    return specs


def serve_specs(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    threads: int = 1,
    extra_args: Sequence[str] = (),
) -> list[ServerSpec]:
    """``agentrl serve`` processes (the built-in engine), e.g. for tests or CPU evaluation."""
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_servers)]
    return [
        ServerSpec(
            [sys.executable, "-m", "agentrl.engines.serve", "--model", str(model_path), "--host", host, "--port", str(port), *extra_args],
            port,
            host,
            {"OMP_NUM_THREADS": str(threads)},
        )
        for port in ports
    ]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""Start inference servers as subprocesses, wait until they generate, and stop them cleanly.

Two kinds of server speak the same protocol: SGLang (``python -m sglang.launch_server``, one per
GPU or tensor-parallel group, each pinned to its GPUs with ``CUDA_VISIBLE_DEVICES``) and
``agentrl serve`` (the built-in engine; what the tests start). Each server runs in a process
group of its own (SGLang forks scheduler and detokenizer processes), so stopping one ends all
of its processes: SIGTERM, then SIGKILL after a grace period.

    specs = sglang_specs("/ckpt/policy", num_servers=4, tp_size=2, python="/envs/sglang/bin/python")
    with launch_servers(specs) as servers:
        engine = SGLangEngine(servers.urls, api_key=servers.api_key)

Readiness means ``GET /health_generate`` answered 200: the server ran one token through its
model, not merely opened its port.

Every launch has an API key (``new_api_key()`` unless one is given), shared by its servers and
required by them on every endpoint but ``/health``: ``agentrl serve`` reads it from
``AGENTRL_API_KEY`` in its environment, SGLang from ``--api-key`` (its only way; the key is then
visible in the process list of this machine). ``servers.api_key`` is what clients pass
(``SGLangEngine(servers.urls, api_key=servers.api_key)``). A server's output is copied to its log
file with the key replaced by ``<api-key>`` (SGLang prints its arguments at start-up).

Each server gets a temporary directory of its own as ``TMPDIR`` (unless its spec sets one),
removed when it is stopped: SGLang names its inter-process sockets with temporary files it never
removes, so every server start used to leave four sockets and files in the machine's ``/tmp``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from agentrl.engines.guard import API_KEY_ENV, auth_headers, new_api_key, require_key_off_loopback
from agentrl.engines.lifeline import TMPDIR_ENV as LIFELINE_TMPDIR_ENV
from agentrl.errors import EngineUnavailable

__all__ = ["ServerSpec", "ServerProcess", "LaunchedServers", "launch_servers", "sglang_specs", "serve_specs", "free_port", "with_lifeline"]


@dataclass(frozen=True)
class ServerSpec:
    command: list[str]
    port: int
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    api_key: str | None = field(default=None, repr=False)  # the server's key (in its env as AGENTRL_API_KEY)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __repr__(self) -> str:  # SGLang's command line holds the key
        command = ["<api-key>" if self.api_key and arg == self.api_key else arg for arg in self.command]
        return f"ServerSpec(command={command!r}, port={self.port}, host={self.host!r}, env={self.env!r})"


class ServerProcess:
    """One running server (its whole process group)."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, log_path: Path, log_copier: threading.Thread | None = None,
                 temp_dir: Path | None = None):
        self.spec, self.process, self.log_path = spec, process, log_path
        self.url = spec.url
        self._log_copier = log_copier
        self.temp_dir = temp_dir  # the server's TMPDIR, made for it: removed once it is stopped

    @property
    def api_key(self) -> str | None:
        return self.spec.api_key

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def archive_log(self, suffix: str) -> None:
        """Keep this (dead) server's log beside the next one's, as ``server-<port>.log.<suffix>``."""
        if self.log_path.exists():
            self.log_path.rename(self.log_path.with_suffix(f".log.{suffix}"))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        import httpx  # here: a run on the built-in engine loads this module but waits on no server (httpx brings rich, click)

        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=30.0, headers=auth_headers(self.api_key)) as client:
            while True:
                if not self.alive():
                    self._drain_log()  # the copier may still hold the last lines, the ones that say why
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
        self._drain_log()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def _drain_log(self) -> None:
        """Wait (briefly) until the output copier has written everything the process printed."""
        if self._log_copier is not None:
            self._log_copier.join(timeout=5.0)

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


class LaunchedServers:
    """The servers of one launch; a context manager that stops them all."""

    def __init__(self, servers: list[ServerProcess], temp_log_dir: Path | None = None):
        self.servers = servers
        self.temp_log_dir = temp_log_dir  # made by launch_servers (no log_dir given): removed by stop()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def api_key(self) -> str | None:
        """The key the servers of this launch share (what clients send)."""
        keys = {s.api_key for s in self.servers}
        return keys.pop() if len(keys) == 1 else None

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        if self.temp_log_dir is not None:  # the caller asked for no logs; a failed start keeps them (its error names them)
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
            self.temp_log_dir = None

    def __enter__(self) -> "LaunchedServers":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def launch_servers(specs: Sequence[ServerSpec], *, ready_timeout_s: float = 600.0, log_dir: str | Path | None = None) -> LaunchedServers:
    """Start every server, then wait for all of them; on any failure stop them all and raise."""
    for spec in specs:  # refused before anything is made
        require_key_off_loopback(spec.host, spec.api_key, program="launch_servers")
    log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="agentrl-servers-"))
    log_root.mkdir(parents=True, exist_ok=True)
    started: list[ServerProcess] = []
    try:
        for spec in specs:
            log_path = log_root / f"server-{spec.port}.log"
            env = {**os.environ, **spec.env}
            env.pop(API_KEY_ENV, None)  # this process's own key is not the server's
            if spec.api_key:
                env[API_KEY_ENV] = spec.api_key
            # short (Unix socket paths are capped at 107 bytes), beside this process's temp files
            temp_dir = None if "TMPDIR" in spec.env else Path(tempfile.mkdtemp(prefix="agentrl-srv-"))
            if temp_dir is not None:
                env["TMPDIR"] = str(temp_dir)
                env[LIFELINE_TMPDIR_ENV] = str(temp_dir)  # removed by a lifeline whose owner died
            try:
                process = subprocess.Popen(
                    spec.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except BaseException:
                if temp_dir is not None:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                raise
            copier = threading.Thread(target=_copy_redacted, args=(process.stdout, log_path, spec.api_key), daemon=True,
                                      name=f"log-{spec.port}")
            copier.start()
            started.append(ServerProcess(spec, process, log_path, copier, temp_dir))
        deadline = time.monotonic() + ready_timeout_s
        for server in started:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for server in started:
            server.stop(grace_s=2.0)
        if not started and not log_dir:  # no server started: no log to keep
            shutil.rmtree(log_root, ignore_errors=True)
        raise
    return LaunchedServers(started, temp_log_dir=None if log_dir else log_root)


def _copy_redacted(stream, log_path: Path, secret: str | None) -> None:
    """Copy a server's output to its log, line by line, with its API key blanked out."""
    needle = secret.encode() if secret else None
    with stream, open(log_path, "wb") as log:
        for line in iter(stream.readline, b""):
            log.write(line.replace(needle, b"<api-key>") if needle else line)
            log.flush()


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
    api_key: str | None = None,
) -> list[ServerSpec]:
    """One SGLang server per group of ``tp_size`` GPUs: server i sees GPUs i*tp .. i*tp+tp-1.
    ``api_key``: default a fresh one (``new_api_key``), shared by the servers."""
    api_key = api_key or new_api_key()
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
            "--api-key", api_key,
            *extra_args,
        ]  # fmt: skip
        specs.append(ServerSpec(command, port, host, {"CUDA_VISIBLE_DEVICES": gpus}, api_key=api_key))
    return specs


def serve_specs(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    threads: int = 1,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> list[ServerSpec]:
    """``agentrl serve`` processes (the built-in engine), e.g. for tests or CPU evaluation.
    ``api_key``: default a fresh one, shared by the servers (passed in their environment)."""
    api_key = api_key or new_api_key()
    ports = list(ports) if ports is not None else [free_port(host) for _ in range(num_servers)]
    return [
        ServerSpec(
            [sys.executable, "-m", "agentrl.engines.serve", "--model", str(model_path), "--host", host, "--port", str(port), *extra_args],
            port,
            host,
            {"OMP_NUM_THREADS": str(threads)},
            api_key=api_key,
        )
        for port in ports
    ]


def with_lifeline(spec: ServerSpec, owner_pid: int | None = None) -> ServerSpec:
    """The same server run under ``agentrl.engines.lifeline``: it ends when ``owner_pid`` (this
    process by default) ends, however it ends."""
    owner = os.getpid() if owner_pid is None else owner_pid
    return replace(spec, command=[sys.executable, "-m", "agentrl.engines.lifeline", str(owner), "--", *spec.command])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

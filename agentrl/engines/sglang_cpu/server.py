"""Start a real SGLang server on a CPU, wait until it generates, and tear it down.

The server runs from the cached SGLang venv (see ``env.py``) with ``SGLANG_USE_CPU_ENGINE=1``
and the pure-torch ``sgl_kernel`` stand-in first on its ``PYTHONPATH``, in a process group of its
own (SGLang forks a scheduler and a detokenizer process), so ``stop`` ends all of them at once.
It needs about 3.5 to 4 GB of RAM across its three processes.

    with launch_sglang_cpu_server(model_dir) as server:
        httpx.post(f"{server.url}/generate", json={"input_ids": [...], ...})
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from agentrl.engines.sglang_cpu.env import SHIM_DIR, unavailable_reason, venv_dir, venv_python
from agentrl.errors import EngineUnavailable

__all__ = ["SGLangCPUServer", "launch_sglang_cpu_server", "server_command", "server_env"]

# Why each flag: the CPU engine's only attention and sampling backends that need no compiled
# kernels; overlap scheduling assumes CUDA streams; fp32 because bf16 is 14-25x slower on this
# CPU; without a cap SGLang reserves ~15 GB of KV cache; warm-up is replaced by our own readiness
# check on /health_generate.
CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--dtype", "float32",
    "--skip-server-warmup",
)  # fmt: skip


def server_command(
    model_path: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    max_total_tokens: int = 65536,
    extra_args: Sequence[str] = (),
    venv: Path | None = None,
) -> list[str]:
    return [
        str(venv_python(venv)), "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        *CPU_FLAGS,
        "--max-total-tokens", str(max_total_tokens),
        "--port", str(port),
        "--host", host,
        *extra_args,
    ]  # fmt: skip


def server_env(*, threads: int = 2, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the stand-in shadows the installed sgl_kernel in this process only."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)  # agentrl's venv; the server runs from its own interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["OMP_NUM_THREADS"] = str(threads)
    return env


class SGLangCPUServer:
    """A running server (its process group). ``stop`` is idempotent; use it as a context manager."""

    def __init__(self, process: subprocess.Popen, *, url: str, port: int, log_path: Path):
        self.process = process
        self.url = url
        self.port = port
        self.log_path = log_path
        self.ready_after_s: float | None = None  # seconds from spawn to the first /health_generate 200

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of every process in the server's process group."""
        return sum(rss for _, rss in _group_members(self.process.pid))

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after ``timeout_s``."""
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._group_alive():
            self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _group_alive(self) -> bool:
        self.process.poll()  # reap the leader so it stops counting
        return bool(_group_members(self.process.pid))

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> SGLangCPUServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def launch_sglang_cpu_server(
    model_path: str | Path,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    max_total_tokens: int = 65536,
    threads: int = 2,
    ready_timeout_s: float = 120.0,
    log_path: str | Path | None = None,
    extra_args: Sequence[str] = (),
    venv: Path | None = None,
) -> SGLangCPUServer:
    """Spawn the server and return once ``/health_generate`` answers 200 (a real generation ran).

    Raises ``EngineUnavailable`` (after stopping the process group) when the venv is missing,
    the server exits during start-up, or it is not ready within ``ready_timeout_s``; the message
    carries the end of the server's log.
    """
    venv = venv or venv_dir()
    reason = unavailable_reason(venv)
    if reason is not None:
        raise EngineUnavailable(reason)
    if not (Path(model_path) / "config.json").is_file():
        raise EngineUnavailable(f"{model_path} has no config.json: not a model directory SGLang can serve")
    port = port or _free_port(host)
    log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"agentrl-sglang-{port}.log"
    cmd = server_command(model_path, port=port, host=host, max_total_tokens=max_total_tokens, extra_args=extra_args, venv=venv)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, env=server_env(threads=threads), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    server = SGLangCPUServer(process, url=f"http://{host}:{port}", port=port, log_path=log_path)
    try:
        _wait_until_ready(server, started + ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    server.ready_after_s = time.monotonic() - started
    return server


def _wait_until_ready(server: SGLangCPUServer, deadline: float) -> None:
    with httpx.Client(timeout=30.0) as client:
        while True:
            if not server.alive():
                raise EngineUnavailable(
                    f"SGLang exited with status {server.process.returncode} during start-up "
                    f"(log {server.log_path}):\n{server.log_tail()}"
                )
            try:
                # /health only says the HTTP front is up; /health_generate runs one token through
                # the scheduler and the model, which is what "ready" has to mean here.
                if client.get(f"{server.url}/health_generate").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"SGLang was not ready within the start-up timeout (log {server.log_path}):\n{server.log_tail()}"
                )
            time.sleep(1.0)


def _group_members(pgid: int) -> list[tuple[int, int]]:
    """(pid, rss bytes) of the live (not zombie) processes in a process group, read from /proc."""
    page = os.sysconf("SC_PAGE_SIZE")
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except OSError:
            continue  # the process ended while we listed it
        state, group, rss_pages = fields[0], int(fields[2]), int(fields[21])
        if group == pgid and state != "Z":
            members.append((int(stat.parent.name), rss_pages * page))
    return members


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""The ``python`` tool: runs model-written code in a separate, limited process.

Isolation (when the process may create namespaces, e.g. as root in a container; checked once
when the tool is constructed and reported in every result's metrics as ``isolated``):

* new PID namespace: the program cannot see or signal anything outside; when it ends (or is
  killed) every process it started, detached ones included, is killed by the kernel;
* new network namespace: no interface but a down loopback, so no network at all;
* new mount namespace with private tmpfs over /tmp, /var/tmp and /dev/shm: the working
  directory lives there and everything written to them vanishes with the sandbox;
* an unprivileged uid of its own per pool slot, so it cannot write outside world-writable
  places and the process limit binds (limits on processes do not bind root);
* resource limits: CPU seconds, address space, processes, file size, open files, no core
  dumps; a wall-clock timeout enforced from outside; output truncated with a marker;
* a clean environment (PATH, HOME, TMPDIR, LANG only): no inherited secrets.

Not isolated: the program can read world-readable files of the host (the file system is not
replaced, only the temporary directories), use the CPU within its limits (it competes with
training), and call any syscall the kernel allows (no seccomp filter).

Without namespaces (not root, or no ``unshare``), the tool still runs the program in its own
session with the resource limits, a fresh temporary directory and a clean environment, but the
network is NOT isolated, detached children may survive, and the process limit is skipped when
running as root. ``PythonTool.isolation`` says which mode is in force.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from agentrl.agent.tool import Tool, ToolResult

__all__ = ["PythonTool", "SandboxLimits"]

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
_UID_BASE = 61000  # one unprivileged uid per pool slot: 61000, 61001, ...


class SandboxLimits:
    """The limits of one run, each configurable through the tool's config."""

    __slots__ = (
        "wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_output_bytes",
        "max_file_mb", "max_open_files", "tmpfs_mb",
    )

    def __init__(
        self,
        *,
        wall_time_s: float = 10.0,
        cpu_time_s: int = 5,
        memory_mb: int = 512,
        max_processes: int = 16,
        max_output_bytes: int = 8192,
        max_file_mb: int = 16,
        max_open_files: int = 64,
        tmpfs_mb: int = 64,
    ):
        self.wall_time_s = wall_time_s
        self.cpu_time_s = cpu_time_s
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.max_file_mb = max_file_mb
        self.max_open_files = max_open_files
        self.tmpfs_mb = tmpfs_mb


def _world_executable(path: str) -> bool:
    """Whether an unprivileged user can execute ``path`` (every directory on the way searchable)."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & 0o001:
        return False
    return all(parent.stat().st_mode & 0o001 for parent in real.parents)


def _sandbox_python() -> str | None:
    """An interpreter the sandbox's unprivileged uid may run (a venv under /root is not one)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if candidate and _world_executable(candidate):
            return candidate
    return None


def _namespaces_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc", "true"],
        capture_output=True,
        timeout=10,
    )
    return probe.returncode == 0


class PythonTool(Tool):
    name = "python"
    description = "Run a Python 3 program and return what it prints (stdout and stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the complete program to run"}},
        "required": ["code"],
    }

    def __init__(self, *, max_concurrency: int = 4, **limits: Any) -> None:
        super().__init__(max_concurrency=max_concurrency, **limits)
        self.limits = SandboxLimits(**limits)
        self.sandbox_python = _sandbox_python()
        self.isolation = "namespaces" if self.sandbox_python and _namespaces_available() else "process"
        self._max_concurrency = max_concurrency
        # A slot is a sandbox uid; the semaphore (one per event loop: asyncio primitives are
        # bound to a loop) caps how many run at once, so a free slot always exists inside it.
        self._free_slots = list(range(max_concurrency))
        self._semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.setdefault(loop, asyncio.Semaphore(self._max_concurrency))
        async with semaphore:
            slot = self._free_slots.pop()
            try:
                return await self._run(arguments["code"], slot)
            finally:
                self._free_slots.append(slot)

    async def _spawn(self, slot: int) -> tuple[asyncio.subprocess.Process, Path | None]:
        lim = self.limits
        if self.isolation == "namespaces":
            spec = {
                "uid": _UID_BASE + slot,
                "python": self.sandbox_python,
                "cpu_time_s": lim.cpu_time_s,
                "memory_mb": lim.memory_mb,
                "max_processes": lim.max_processes,
                "max_file_mb": lim.max_file_mb,
                "max_open_files": lim.max_open_files,
                "tmpfs_mb": lim.tmpfs_mb,
            }
            argv = [
                "unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc", "--",
                sys.executable, "-I", "-S", str(_BOOT), json.dumps(spec),
            ]
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, env={"PATH": "/usr/bin:/bin"},
            )
            return proc, None
        workdir = Path(tempfile.mkdtemp(prefix="agentrl-py-"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-u", "-c", "import sys; exec(compile(sys.stdin.read(), 'main.py', 'exec'))",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=workdir, start_new_session=True, preexec_fn=self._process_limits,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"},
        )
        return proc, workdir

    def _process_limits(self) -> None:
        import resource

        lim = self.limits
        pairs = [
            (resource.RLIMIT_CPU, lim.cpu_time_s),
            (resource.RLIMIT_AS, lim.memory_mb * 1024 * 1024),
            (resource.RLIMIT_FSIZE, lim.max_file_mb * 1024 * 1024),
            (resource.RLIMIT_NOFILE, lim.max_open_files),
            (resource.RLIMIT_CORE, 0),
        ]
        if os.geteuid() != 0:
            pairs.append((resource.RLIMIT_NPROC, lim.max_processes))
        for kind, value in pairs:
            resource.setrlimit(kind, (value, value + 1 if kind == resource.RLIMIT_CPU else value))

    async def _run(self, code: str, slot: int) -> ToolResult:
        lim = self.limits
        start = time.monotonic()
        proc, workdir = await self._spawn(slot)
        kept = bytearray()
        total = 0
        timed_out = False

        async def pump() -> None:
            nonlocal total
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            while chunk := await proc.stdout.read(65536):
                total += len(chunk)
                if len(kept) < lim.max_output_bytes:
                    kept.extend(chunk[: lim.max_output_bytes - len(kept)])
                if total > 64 * lim.max_output_bytes:
                    _kill_group(proc)  # a flood of output: stop it rather than drain it for the whole wall time
            await proc.wait()

        try:
            await asyncio.wait_for(pump(), timeout=lim.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc)
            await proc.wait()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        wall = time.monotonic() - start

        text = kept.decode("utf-8", errors="replace")
        if total > len(kept):
            text += f"\n...[output truncated: {total - len(kept)} more bytes]"
        status = _describe_exit(proc.returncode, timed_out, lim)
        if status:
            text = f"{text}\n{status}" if text else status
        metrics = {
            "exit_code": float(proc.returncode if proc.returncode is not None else -1),
            "timed_out": float(timed_out),
            "truncated": float(total > len(kept)),
            "wall_s": wall,
            "isolated": float(self.isolation == "namespaces"),
        }
        return ToolResult(text=text if text else "(no output)", metrics=metrics)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _describe_exit(returncode: int | None, timed_out: bool, lim: SandboxLimits) -> str:
    if timed_out:
        return f"Error: the program exceeded the wall-time limit of {lim.wall_time_s:g} s and was killed."
    if returncode in (None, 0):
        return ""
    # Under `unshare --fork`, a signal that kills the program is reported as 128 + signal.
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else None
    if sig == signal.SIGXCPU:
        return f"Error: the program exceeded the CPU-time limit of {lim.cpu_time_s} s and was killed."
    if sig == signal.SIGXFSZ:
        return f"Error: the program exceeded the file-size limit of {lim.max_file_mb} MB."
    if sig is not None and sig in signal.valid_signals():
        return f"Error: the program was killed by signal {signal.Signals(sig).name}."
    return f"Error: the program exited with status {returncode}."

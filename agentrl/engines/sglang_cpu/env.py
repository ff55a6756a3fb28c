"""Build, find and check the cached virtual environment that runs real SGLang on a CPU.

SGLang pins its own torch (a CUDA build, which also runs on a CPU) and its own transformers, so
it cannot share agentrl's environment: it lives in a venv of its own, built once and cached at
``~/.cache/agentrl/sglang-venv-<version>`` (``AGENTRL_SGLANG_VENV`` overrides the path).

    python -m agentrl.engines.sglang_cpu build [--best-effort] [--timeout S]
    python -m agentrl.engines.sglang_cpu status     # exit 0 when ready, 1 otherwise
    python -m agentrl.engines.sglang_cpu path

A build is idempotent: the marker file is written only after pip succeeded and a smoke import
of the server stack passed, a second build with the marker present does nothing, and a build
that was interrupted is resumed by pip (already installed packages are kept). Concurrent builds
of the same path wait on a lock file. ``--best-effort`` (for CI) always exits 0 and records why
a build was impossible, so the real-SGLang tests skip with that reason instead of failing.

This module uses only the standard library: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "SGLANG_VERSION",
    "VENV_ENV_VAR",
    "BuildError",
    "venv_dir",
    "venv_python",
    "is_ready",
    "unavailable_reason",
    "build",
    "build_log_path",
    "cli_main",
]

SGLANG_VERSION = "0.5.23"
VENV_ENV_VAR = "AGENTRL_SGLANG_VENV"
READY_MARKER = ".agentrl-ready"  # JSON: sglang version, build seconds; written last
FAILURE_NOTE = ".agentrl-build-failed"  # the reason the last build gave up, for skip messages
# The install needs about 11 GB (torch's CUDA build and its nvidia-* wheels); pip unpacks wheels
# next to the venv, so ask for some headroom before downloading gigabytes for nothing.
REQUIRED_FREE_BYTES = 14 * 1024**3
SHIM_DIR = Path(__file__).resolve().parent / "shim"

# What the server imports on the CPU path (the last two import the stand-in's two real ops, the
# scheduler chain its placeholders); importing it proves the venv and the stand-in fit together.
_SMOKE_IMPORTS = (
    "import torch, transformers, sglang, sgl_kernel; "
    "import sglang.srt.entrypoints.http_server; "
    "import sglang.srt.managers.scheduler; "
    "import sglang.srt.mem_cache.allocation; "
    "import sglang.kernels.ops.kvcache.cache_move; "
    "assert torch.__version__.startswith('2.14'), torch.__version__; "
    "assert hasattr(torch.ops.sgl_kernel, 'assign_req_to_token_pool_cpu')"
)


class BuildError(RuntimeError):
    """The SGLang venv could not be built; the message says why and what to do."""


def venv_dir() -> Path:
    override = os.environ.get(VENV_ENV_VAR)
    if override:
        return Path(override).expanduser().resolve()
    return Path.home() / ".cache" / "agentrl" / f"sglang-venv-{SGLANG_VERSION}"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def is_ready(venv: Path | None = None) -> bool:
    venv = venv or venv_dir()
    return (venv / READY_MARKER).is_file() and venv_python(venv).exists()


def unavailable_reason(venv: Path | None = None) -> str | None:
    """None when the venv is ready; otherwise a sentence for a pytest skip."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return None
    hint = f"build it with `python -m agentrl.engines.sglang_cpu build` (or set {VENV_ENV_VAR})"
    failure = venv / FAILURE_NOTE
    if failure.is_file():
        return f"the SGLang CPU venv at {venv} failed to build ({failure.read_text().strip()}); {hint}"
    return f"no SGLang CPU venv at {venv}; {hint}"


def build_log_path(venv: Path | None = None) -> Path:
    venv = venv or venv_dir()
    return venv.parent / f"{venv.name}.build.log"


def build(venv: Path | None = None, *, python: str = sys.executable, timeout_s: float | None = None) -> Path:
    """Create (or finish) the venv and install sglang into it; returns the venv path.

    pip's output goes to ``build_log_path(venv)``. On failure the reason is also written into
    the venv folder (``unavailable_reason`` reports it) and ``BuildError`` is raised.
    """
    venv = venv or venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits, then finds the marker
        if is_ready(venv):
            print(f"sglang venv ready at {venv}", file=sys.stderr)
            return venv
        log_path = build_log_path(venv)
        print(f"building the sglang {SGLANG_VERSION} venv at {venv} (log {log_path})", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            with open(log_path, "w") as log:
                _install(venv, python, None if timeout_s is None else started + timeout_s, log)
        except (BuildError, OSError) as exc:
            _record_failure(venv, str(exc) if isinstance(exc, BuildError) else f"{type(exc).__name__}: {exc}")
            raise BuildError(f"{exc} (log {log_path})") from exc
        seconds = round(time.monotonic() - started, 1)
        marker = {"sglang": SGLANG_VERSION, "build_seconds": seconds, "python": platform.python_version()}
        (venv / READY_MARKER).write_text(json.dumps(marker) + "\n")
        print(f"sglang venv built at {venv} in {seconds} s", file=sys.stderr)
        return venv


def _install(venv: Path, python: str, deadline: float | None, log) -> None:
    _check_machine(venv)
    if not _python_runs(venv):
        if venv.exists():
            print(f"removing an unusable venv at {venv}", file=log)
            shutil.rmtree(venv)
        _run([python, "-m", "venv", str(venv)], deadline, log, what="python -m venv")
    (venv / FAILURE_NOTE).unlink(missing_ok=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--no-cache-dir", "--progress-bar", "off"]
    _run([*pip, f"sglang=={SGLANG_VERSION}"], deadline, log, what=f"pip install sglang=={SGLANG_VERSION}")
    _smoke_test(venv, deadline, log)


def _record_failure(venv: Path, reason: str) -> None:
    try:
        venv.mkdir(parents=True, exist_ok=True)
        (venv / FAILURE_NOTE).write_text(reason + "\n")
    except OSError:
        pass  # nowhere to write: the skip message will just say the venv is missing


def _check_machine(venv: Path) -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise BuildError(f"the SGLang CPU path is set up for linux x86_64, not {sys.platform} {platform.machine()}")
    if not is_ready(venv):
        probe = venv if venv.exists() else venv.parent
        free = shutil.disk_usage(probe).free
        installed = _tree_bytes(venv) if venv.exists() else 0
        if free + installed < REQUIRED_FREE_BYTES:
            raise BuildError(
                f"{free / 1024**3:.1f} GiB free under {probe}, the SGLang venv needs about "
                f"{REQUIRED_FREE_BYTES / 1024**3:.0f} GiB; free space or point {VENV_ENV_VAR} elsewhere"
            )


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _python_runs(venv: Path) -> bool:
    python = venv_python(venv)
    if not python.exists():
        return False
    try:  # a broken interpreter may hang at start-up rather than fail: bounded
        return subprocess.run([str(python), "-c", "pass"], capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise BuildError("the build ran out of time")
    return left


def _run(cmd: Sequence[str], deadline: float | None, log, *, what: str, env: dict[str, str] | None = None) -> None:
    print(f"$ {' '.join(cmd)}", file=log, flush=True)
    try:
        result = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=_remaining(deadline), env=env
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{what} ran out of time") from exc
    if result.returncode != 0:
        raise BuildError(f"{what} exited with status {result.returncode}")


def _smoke_test(venv: Path, deadline: float | None, log) -> None:
    env = dict(os.environ, PYTHONPATH=str(SHIM_DIR), SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    _run([str(venv_python(venv)), "-c", _SMOKE_IMPORTS], deadline, log, what="the smoke import of sglang", env=env)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl.engines.sglang_cpu", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build the venv unless it is ready")
    build_cmd.add_argument("--best-effort", action="store_true", help="exit 0 even when the build fails (CI)")
    build_cmd.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    build_cmd.add_argument("--python", default=sys.executable, help="interpreter to base the venv on")
    sub.add_parser("status", help="exit 0 when the venv is ready, 1 otherwise (prints why)")
    sub.add_parser("path", help="print the venv path")
    args = parser.parse_args(argv)

    if args.command == "path":
        print(venv_dir())
        return 0
    if args.command == "status":
        reason = unavailable_reason()
        print(reason or f"ready: {venv_dir()} ({(venv_dir() / READY_MARKER).read_text().strip()})")
        return 0 if reason is None else 1
    try:
        build(python=args.python, timeout_s=args.timeout)
        return 0
    except BuildError as exc:
        log_path = build_log_path()
        if log_path.is_file():  # the end of pip's output usually says what went wrong
            print("\n".join(log_path.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)
        print(f"sglang venv not built: {exc}", file=sys.stderr)
        return 0 if args.best_effort else 1

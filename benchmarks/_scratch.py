"""Where a benchmark run writes its files: one scratch directory, removed when the run ends.

A benchmark saves models for servers, starts servers that write logs, trains into run
directories and may start a private Ray cluster; left behind, a run of ``agentrl bench engine``
leaves tens of megabytes in the temp dir. Everything a run writes goes under ``scratch_dir``'s
directory, which is removed when the run ends: by returning, by an error, by Ctrl-C, or by
SIGTERM (turned into ``SystemExit`` while the run is inside it, so the cleanup runs). Only
SIGKILL leaves it, as it leaves anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["scratch_dir", "private_ray_temp_dir"]


@contextmanager
def _sigterm_raises_system_exit() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def scratch_dir(name: str, *, keep: str | Path | None = None) -> Iterator[Path]:
    """A fresh directory under the temp dir, removed on exit; ``keep``: this directory instead,
    created if needed and left in place (to look at what a run wrote)."""
    if keep is not None:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"agentrl-bench-{name}-"))
    try:
        with _sigterm_raises_system_exit():
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def private_ray_temp_dir() -> Iterator[Path | None]:
    """Point a Ray cluster started inside the block at its own directory (``RAY_TMPDIR``), and
    remove it after the block has shut Ray down. A separate, short path next to the scratch
    directory, not inside it: Ray puts unix sockets in it, whose paths may not exceed 107
    bytes. Nothing is changed when the run joins an existing cluster (``RAY_ADDRESS``) or the
    caller already chose a Ray temp dir: their files are not the benchmark's to remove."""
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_TMPDIR"):
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="agentrl-ray-"))
    os.environ["RAY_TMPDIR"] = str(path)
    try:
        with _sigterm_raises_system_exit():
            yield path
    finally:
        del os.environ["RAY_TMPDIR"]
        try:
            import ray

            if ray.is_initialized():  # an error before the trainer's own shutdown
                ray.shutdown()
        except ImportError:
            pass
        shutil.rmtree(path, ignore_errors=True)

"""Where a run's start-up goes: the seconds of each phase before the first step, from the start
of the process (interpreter, imports and config count too), written to ``metrics.jsonl`` (step
0, ``startup/*``), the summary and the report, and printed on the console."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

__all__ = ["StartupClock", "pause_collector", "resume_collector", "seconds_since_process_start"]

# whether pause_collector turned the collector off (resume_collector turns on only what it turned off)
_paused = False


def pause_collector() -> bool:
    """Turn Python's cyclic garbage collector off while the process starts: its imports (torch,
    transformers' model code) and the model's load allocate hundreds of thousands of objects that
    live as long as the process, and the collector's full passes over them, each one triggered as
    the heap grows by a quarter, are a large part of a command's start-up (docs/benchmarks.md, the
    trainer's end to end). Objects without cycles are still freed as they go. For a process about
    to do a job (``agentrl train``), which calls ``resume_collector`` once its models are loaded.
    Returns whether it turned the collector off (not when it was already off)."""
    global _paused
    if not gc.isenabled():
        return False
    gc.disable()
    _paused = True
    return True


def resume_collector() -> bool:
    """End ``pause_collector``'s pause: one full collection of what the start-up left (its
    survivors go to the oldest generation, so the collections of the job's own objects do not
    pass over them again), then the collector runs as usual. Nothing when no pause is on (a
    library caller's process keeps its own collector settings). Returns whether it ended one."""
    global _paused
    if not _paused:
        return False
    _paused = False
    gc.collect()
    gc.enable()
    return True


def seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, starttime, counted from the one after the name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Laps of named phases; a phase lapped twice adds up."""

    def __init__(self, *, count_process: bool = True) -> None:
        # interpreter, imports, config: from the process start (not for a restart within the process)
        self.before_setup = seconds_since_process_start() if count_process else None
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._mark
        self._mark = now

    def metrics(self) -> dict[str, float]:
        phases = dict(self.phases)
        if self.before_setup is not None:
            phases = {"imports_and_config": self.before_setup, **phases}
        out = {f"startup/{name}_s": round(seconds, 3) for name, seconds in phases.items()}
        out["startup/total_s"] = round(sum(phases.values()), 3)
        return out

    def line(self) -> str:
        """One console line, the phases in order: ``start-up 9.1 s before the first step: imports and config 3.0, ...``."""
        parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in
                          ([("imports_and_config", self.before_setup)] if self.before_setup is not None else []) + list(self.phases.items()))
        total = sum(self.phases.values()) + (self.before_setup or 0.0)
        return f"start-up {total:.1f} s before the first step: {parts}"

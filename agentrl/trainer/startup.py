"""Where a run's start-up goes: the seconds of each phase before the first step, from the start
of the process (interpreter, imports and config count too), written to ``metrics.jsonl`` (step
0, ``startup/*``), the summary and the report, and printed on the console."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["StartupClock", "seconds_since_process_start"]


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

"""The run directory: where ``agentrl train``, ``sft``, ``rollout`` and ``replay train`` write.

    <trainer.runs_root>/<trainer.run_name>/     (the name defaults to the start time)
      config.yaml          the resolved config (replay finds the tokenizer and loops here)
      metrics.jsonl        one JSON object per logged step
      metrics.superseded.jsonl  rows a resumed run set aside: the steps after its checkpoint that
                           a killed run had logged (each with ``superseded_at`` and ``superseded_reason``)
      rollouts/            the rollout store (parquet shards, the replay format)
      rollouts/superseded/<time>/  shards a resumed run set aside (``RolloutStore.set_aside_after``)
      checkpoints/step_N/  trainer state, written whole or not at all; the last few are kept
      checkpoints/final/   the end of ``agentrl sft``
      policy/              the trained policy as a transformers checkpoint
      policies/step_N/     policies exported along the way (``agentrl sft``, ``trainer.save_freq``)
      sft_policy/          the SFT warm start's policy (``agentrl train``)
      engine_weights/      the checkpoint the engine reloads (``engine.weight_sync=disk``)
      data/                generated task data
      summary.json         the job's summary
      report.html          metrics over steps and sample trajectories

A foundation module: it knows paths and files, not workers, engines or stores, so every layer
can use it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig
    from agentrl.trajectory import Trajectory

__all__ = ["RunDir", "make_run_dir", "config_yaml", "utc_stamp"]

TRAINER_STATE = "trainer_state.json"  # a checkpoint is complete when this file is in it


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def metrics_superseded(self) -> Path:
        return self.path / "metrics.superseded.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.path / "rollouts"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def policy(self) -> Path:
        return self.path / "policy"

    @property
    def sft_policy(self) -> Path:
        return self.path / "sft_policy"

    @property
    def engine_weights(self) -> Path:
        return self.path / "engine_weights"

    @property
    def data(self) -> Path:
        return self.path / "data"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def report(self) -> Path:
        return self.path / "report.html"

    def policy_at(self, step: int) -> Path:
        return self.path / "policies" / f"step_{step}"

    def checkpoint(self, step: int | str) -> Path:
        return self.checkpoints / f"step_{step}" if isinstance(step, int) else self.checkpoints / step

    # ------------------------------------------------------------------ files
    def write_config(self, cfg: "TrainConfig") -> Path:
        self.config.write_text(config_yaml(cfg))
        return self.config

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def set_aside_metrics_after(self, step: int, *, reason: str, at: str | None = None) -> int:
        """A run resumed from the checkpoint of ``step`` trains the steps after it again: the rows
        of ``metrics.jsonl`` with a larger step (a killed run's, of a training that no longer
        exists) move to the end of ``metrics.superseded.jsonl``, each with ``superseded_at`` (UTC,
        ``at`` or now) and ``superseded_reason``, so that every step is in ``metrics.jsonl`` once.
        Rows up to ``step`` stay, and so do rows without a numeric step. A line that is not JSON
        (the half-written last row of a killed process) moves too, as ``{"unreadable": text}``.
        The side file is written (and fsynced) before ``metrics.jsonl`` is replaced whole, so a
        crash in between leaves a row in both files, never in neither. Returns the rows moved."""
        if not self.metrics.is_file():
            return 0
        kept: list[str] = []
        moved: list[dict[str, Any]] = []
        for line in self.metrics.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                moved.append({"unreadable": line})
                continue
            later = isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] > step
            if later:
                moved.append(row)
            else:
                kept.append(line)
        if not moved:
            return 0
        stamp = {"superseded_at": at or utc_stamp(), "superseded_reason": reason}
        with self.metrics_superseded.open("a") as f:
            f.writelines(json.dumps({**row, **stamp}) + "\n" for row in moved)
            f.flush()
            os.fsync(f.fileno())
        tmp = self.metrics.with_name(f".{self.metrics.name}.tmp-{os.getpid()}")
        with tmp.open("w") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics)
        return len(moved)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        self.summary.write_text(json.dumps(summary, indent=2))
        return self.summary

    def write_report(self, samples: Sequence["Trajectory"], summary: dict[str, Any], *,
                     decode: Callable[[list[int]], str] | None = None) -> Path:
        """``report.html``: the metrics over steps and a few trajectories, turn by turn."""
        from agentrl.report import render_report

        page = render_report(self.read_metrics(), samples, f"agentrl run {self.name}", decode=decode, summary=summary)
        self.report.write_text(page)
        return self.report

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self) -> Path | None:
        """The complete ``step_N`` checkpoint with the largest N (an interrupted one is ignored)."""
        found = [p for p in self.checkpoints.glob("step_*") if not p.name.endswith(".tmp") and (p / TRAINER_STATE).is_file()]
        return max(found, key=_step_of) if found else None

    @contextmanager
    def new_checkpoint(self, step: int, *, keep: int) -> Iterator[Path]:
        """A directory to write ``checkpoints/step_<step>`` into. It appears whole on exit (an
        interrupted write leaves only ``step_<step>.tmp``, which ``latest_checkpoint`` skips);
        then all but the last ``keep`` checkpoints are deleted."""
        directory = self.checkpoint(step)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        for old in sorted(self.checkpoints.glob("step_*"), key=_step_of)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].removesuffix(".tmp"))


def make_run_dir(cfg: "TrainConfig") -> RunDir:
    """``trainer.resume`` when set (the run continues there), else a new directory under
    ``trainer.runs_root`` named ``trainer.run_name`` (or the start time), ``-1``, ``-2``, ...
    appended when that name is taken. ``trainer.resume=auto`` is replaced by the run it finds
    (``auto_resume``), or by null when there is none."""
    if cfg.trainer.resume == "auto":
        found = auto_resume(Path(cfg.trainer.runs_root), cfg.trainer.run_name)
        cfg.trainer.resume = str(found) if found is not None else None
    if cfg.trainer.resume is not None:
        return RunDir(Path(cfg.trainer.resume))
    name = cfg.trainer.run_name or time.strftime("%Y%m%d-%H%M%S")
    path = Path(cfg.trainer.runs_root).expanduser().resolve() / name
    suffix = 1
    while path.exists():
        path = path.with_name(f"{name}-{suffix}")
        suffix += 1
    path.mkdir(parents=True)
    return RunDir(path)


def auto_resume(runs_root: Path, run_name: str | None) -> Path | None:
    """The run ``trainer.resume=auto`` continues: ``runs_root/run_name`` when it holds a complete
    checkpoint; without a run name, the run under ``runs_root`` whose last complete checkpoint is
    the newest. None: nothing to resume (the command starts a new run)."""
    root = runs_root.expanduser().resolve()
    if run_name is not None:
        candidates = [root / run_name]
    else:
        candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    found = [(checkpoint, run) for run in candidates if run.is_dir() and (checkpoint := RunDir(run).latest_checkpoint()) is not None]
    if not found:
        return None
    return max(found, key=lambda pair: (pair[0] / TRAINER_STATE).stat().st_mtime)[1]


def utc_stamp() -> str:
    """Now in UTC to the second, ISO 8601 (``2026-11-27T04:05:06Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def config_yaml(cfg: "TrainConfig") -> str:
    """The validated config as YAML (every default filled in), loadable with ``load_config``."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(json.loads(cfg.model_dump_json())))

"""Metrics out: the console and ``metrics.jsonl`` always; TensorBoard, wandb and MLflow when
installed and asked for (``logging.loggers``). A logger that is asked for but not installed is
reported once and skipped, never a crash mid-run.

A resumed run rewinds to its checkpoint's step (``MetricsLogger.rewind``): the rows a killed run
logged after it leave ``metrics.jsonl`` for ``metrics.superseded.jsonl``, and TensorBoard is
reopened with ``purge_step`` so that it hides the killed run's events of those steps (event files
cannot be rewritten: TensorBoard drops them when it reads them). wandb and MLflow are not rewound
(docs/training.md says what they show)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agentrl.config.schema import LoggingConfig
from agentrl.rundir import RunDir

__all__ = ["MetricsLogger"]

CONSOLE_KEYS = ("reward/mean", "success_rate", "val/success_rate", "turns/mean", "tool_use_rate", "val/tool_use_rate", "kl/policy_ref",
                "entropy/mean", "actor/pg_loss", "critic/vf_loss", "logprob_mismatch/mean", "timing/step_s", "sft/loss",
                "sft/heldout_greedy_success")
SFT_CONSOLE_EVERY = 25  # SFT steps are many and quick: the console shows one in 25 (and each held-out check)


class MetricsLogger:
    def __init__(self, run_dir: Path, config: LoggingConfig):
        self.config = config
        self.run = RunDir(run_dir)
        self.jsonl = self.run.metrics.open("a")
        self.tb = self.wandb = self.mlflow = None
        if "tensorboard" in config.loggers:
            try:
                self.tb = self._tensorboard()
            except ImportError:
                self.console("tensorboard is not installed: skipping that logger")
        if "wandb" in config.loggers:
            try:
                import wandb

                self.wandb = wandb.init(project=config.project, name=run_dir.name, dir=str(run_dir))
            except ImportError:
                self.console("wandb is not installed: skipping that logger")
        if "mlflow" in config.loggers:
            try:
                import mlflow

                mlflow.set_experiment(config.project)
                self.mlflow = mlflow.start_run(run_name=run_dir.name)
            except ImportError:
                self.console("mlflow is not installed: skipping that logger")

    def _tensorboard(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run.path / "tensorboard"), purge_step=purge_step)

    def rewind(self, step: int, *, reason: str) -> int:
        """The run goes on after ``step`` (its checkpoint's): the rows logged after it are set aside
        (``RunDir.set_aside_metrics_after``) and TensorBoard hides its events after it. Returns
        the rows set aside."""
        self.jsonl.close()
        try:
            moved = self.run.set_aside_metrics_after(step, reason=reason)
        finally:
            self.jsonl = self.run.metrics.open("a")
        if self.tb is not None:
            self.tb.close()
            self.tb = self._tensorboard(purge_step=step + 1)  # events at purge_step and later, from earlier files, are dropped
        return moved

    def console(self, text: str) -> None:
        if "console" in self.config.loggers:
            print(text, file=sys.stderr, flush=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not metrics:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        sft_step = metrics.get("sft/step")
        if sft_step is None or int(sft_step) % SFT_CONSOLE_EVERY == 0 or "sft/heldout_greedy_success" in metrics:
            keys = [*CONSOLE_KEYS, *sorted(k for k in metrics if k.startswith("tool/") and k.endswith("/calls"))]
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            if shown:  # a record with none of the console's keys (e.g. start-up) is in metrics.jsonl only
                self.console(f"[step {step}] {shown}")
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for key, value in numeric.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("/", "_"): v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            import mlflow

            mlflow.end_run()

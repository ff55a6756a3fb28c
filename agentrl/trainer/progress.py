"""What ``agentrl train`` is doing before its first step, one short line on stderr per phase.

A fresh install's first run pays for imports (Python compiles torch's, transformers' and Ray's
bytecode) and the SFT warm start before any RL progress bar appears; on a slow or shared machine
that is minutes. These lines say which phase the wait is in (``agentrl train: loading the
model ...``); the start-up line before step 1 then says how long each took.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl.config.schema import TrainConfig
    from agentrl.trainer.logging import MetricsLogger

__all__ = ["say", "model_line", "workers_line", "rl_line"]


def say(text: str, log: "MetricsLogger | None" = None) -> None:
    """``agentrl train: <text>`` on stderr (through ``log``'s console when given: off with it)."""
    line = f"agentrl train: {text}"
    if log is not None:
        log.console(line)
    else:
        print(line, file=sys.stderr, flush=True)


def model_line(cfg: "TrainConfig") -> str:
    from agentrl.tiny import shipped_skilled_model

    if cfg.model.path is not None:
        return f"model: {cfg.model.path}"
    tiny = cfg.model.tiny
    what = f"the tiny model ({tiny.size} parameters, seed {tiny.seed}"
    if tiny.skills == "none":
        return f"model: building {what})"
    if shipped_skilled_model(tiny.skills, tiny.size, tiny.seed) is not None:
        return f"model: {what}, with the {tiny.skills} skills agentrl ships)"
    return f"model: building {what}) and teaching it the {tiny.skills} skills (once on this machine: minutes)"


def workers_line(cfg: "TrainConfig", *, in_process: bool) -> str:
    groups = ["actor"] + (["reference"] if cfg.use_reference else []) + (["critic"] if cfg.critic.enable else [])
    where = "in this process" if in_process else "as Ray workers"
    return f"loading the policy: {', '.join(groups)} {where}"


def rl_line(cfg: "TrainConfig", *, start_step: int) -> str:
    steps = cfg.trainer.total_steps - start_step
    resumed = f" (resumed after step {start_step})" if start_step else ""
    return (f"RL: {steps} steps of {cfg.data.train_batch_size} rows x {cfg.rollout.n} samples, "
            f"{cfg.algorithm.adv_estimator}{resumed}")

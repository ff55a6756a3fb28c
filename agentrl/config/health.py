"""``trainer.health``: the bounds of the run's health checks (``agentrl/trainer/health.py``), a
section of the schema kept here for ``agentrl/config/schema.py``'s length; its comments are the
keys' documentation as the schema's are (``agentrl.config.help.schema_docs`` reads both)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["HealthBound", "HealthConfig", "GROUP_RELATIVE"]

# the estimators (algorithm.adv_estimator) whose advantage compares a sample with its own group
# only: a group whose samples all got one reward teaches them nothing, which the uniform_groups
# measure watches (a critic's GAE, or REINFORCE++'s batch whitening, still tells such samples apart)
GROUP_RELATIVE = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")


class _Section(BaseModel):  # as schema.Section (which imports this module)
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class HealthBound(_Section):
    warn: float | None = None  # a warning naming the cause when the measure is at or above this (null: never)
    warn_steps: int = Field(1, ge=1)  # ... on this many consecutive steps
    stop: float | None = None  # a checkpoint, then the run stops, at or above this (null: never)
    stop_steps: int = Field(1, ge=1)  # ... on this many consecutive steps


class HealthConfig(_Section):
    # Each step's measures of whether the run can learn; a stop goes to summary.json (docs/training.md "Run health").
    # mean |engine - trainer| logprob of the tokens sampled at the trainer's weight version (fp32: ~1e-7)
    logprob_mismatch: HealthBound = Field(default_factory=lambda: HealthBound(warn=1e-2, stop=1e-2, stop_steps=2))
    uniform_groups: HealthBound = Field(default_factory=lambda: HealthBound(warn=0.9, warn_steps=2, stop=1.0, stop_steps=10))  # share of groups whose samples all got one reward
    tool_errors: HealthBound = Field(default_factory=lambda: HealthBound(warn=0.5, stop=1.0, stop_steps=5))  # share of tool calls failing, per kind (tool_exception, timeout)
    malformed_calls: HealthBound = Field(default_factory=lambda: HealthBound(warn=0.5, warn_steps=3))  # tool_calls/malformed_rate
    failures: HealthBound = Field(default_factory=lambda: HealthBound(warn=0.1))  # failures/rate (trainer.max_failure_rate stops)
    stale_groups: HealthBound = Field(default_factory=lambda: HealthBound(warn=0.5, warn_steps=3, stop=0.9, stop_steps=5))  # share of groups dropped as stale

    @model_validator(mode="before")
    @classmethod
    def _measure_defaults(cls, data: Any) -> Any:  # uniform_groups.warn=0.5 alone keeps that measure's other defaults
        return {k: {**cls().model_dump()[k], **v} if isinstance(v, dict) and k in cls.model_fields else v for k, v in data.items()} if isinstance(data, dict) else data

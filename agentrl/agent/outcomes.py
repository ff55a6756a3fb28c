"""How a batch of trajectories ended, said plainly: counts per finish reason, the first error of
each failing kind in full, and whether the job failed.

``agentrl rollout`` and the replay re-run print this and exit nonzero when the share of failed
trajectories exceeds ``rollout.max_failure_rate``: a run whose every trajectory ended in
``loop_error`` must not look like success. Failed means the episode could not run to an end of
its own (the loop, the engine, the interaction or the environment failed, or the engine
aborted); a trajectory that hit a length or turn limit finished normally. An agent program's
``program_error`` is a scored episode, not a failure, but a job in which every trajectory ended
``program_error`` failed too: a program that gives up whatever the model writes is broken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from agentrl.trajectory import Trajectory, TrajectoryFinish

__all__ = ["FAILED", "FinishSummary", "summarize_finishes"]

FAILED = frozenset({
    TrajectoryFinish.LOOP_ERROR, TrajectoryFinish.ENGINE_ERROR, TrajectoryFinish.INTERACTION_ERROR, TrajectoryFinish.ABORT,
    TrajectoryFinish.ENVIRONMENT_ERROR,
})


@dataclass
class FinishSummary:
    counts: dict[str, int]  # finish reason -> trajectories, most common first
    first_errors: dict[str, str] = field(default_factory=dict)  # failing reason (or program_error) -> its first error, whole
    total: int = 0

    @property
    def failed(self) -> int:
        return sum(n for reason, n in self.counts.items() if TrajectoryFinish(reason) in FAILED)

    @property
    def failed_fraction(self) -> float:
        return self.failed / self.total if self.total else 0.0

    @property
    def all_program_errors(self) -> bool:
        """Every trajectory ended ``program_error``: the agent program raised on each of them."""
        return self.total > 0 and self.counts.get(str(TrajectoryFinish.PROGRAM_ERROR), 0) == self.total

    def exceeds(self, max_failure_rate: float) -> bool:
        """Whether the job failed: more failed trajectories than allowed, every trajectory a
        ``program_error``, or nothing to report."""
        return self.total == 0 or self.failed_fraction > max_failure_rate or self.all_program_errors

    def verdict(self, max_failure_rate: float) -> str | None:
        """Why the job failed, in a sentence, or None when it did not (``exceeds``)."""
        if self.all_program_errors:
            return (f"every one of the {self.total} trajectories ended program_error: the agent program raised "
                    f"whatever the model wrote (its first error is above)")
        if self.exceeds(max_failure_rate):
            return f"{self.failed} of {self.total} trajectories failed, more than rollout.max_failure_rate = {max_failure_rate:g}"
        return None

    def lines(self) -> list[str]:
        out = [f"{self.total} trajectories: " + ", ".join(f"{reason} {n}" for reason, n in self.counts.items())]
        for reason, error in self.first_errors.items():
            out.append(f"first {reason} ({self.counts[reason]} in all): {error}")
        return out


def summarize_finishes(trajectories: Sequence[Trajectory]) -> FinishSummary:
    counts = Counter(str(t.finish_reason) for t in trajectories)
    first: dict[str, str] = {}
    for t in trajectories:
        reason = str(t.finish_reason)
        if (TrajectoryFinish(reason) in FAILED or reason == TrajectoryFinish.PROGRAM_ERROR) and reason not in first:
            first[reason] = f"row {t.row_id} sample {t.sample_index}: {t.reward_info.get('error') or '(no error text)'}"
    return FinishSummary(counts=dict(counts.most_common()), first_errors=first, total=len(trajectories))

"""Re-score stored trajectories with another reward function, without regenerating anything.

The reward function is resolved exactly as during a rollout (``RewardTable``: a plugin of the
``agentrl.rewards`` group, ``format_score`` passed when it takes one) and judges what the base
agent loop judges: the last assistant message. It gets the trajectory's data source and
ground truth, and the stored row's ``extra_info`` (``{}`` when the store has no row).

Only the trajectory reward and the reward function's part of ``reward_info`` change; tool and
interaction entries of ``reward_info`` (``tool_rewards``, ``interaction_score``, ...) and
everything else - tokens, turns and turn rewards, messages, metrics - are kept as they were.
Turn rewards come from tools and interactions, which only a re-run executes again. With
``components`` (``reward.components``) the new reward is composed from the new score and the
stored ``tool_rewards`` and ``interaction_score`` as a rollout composes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from agentrl.config.schema import RewardComponents, RewardConfig
from agentrl.data.row import Row
from agentrl.errors import DataError
from agentrl.data.rollout_store import RolloutStore, TrajectoryFilter, shard_name
from agentrl.rewards import score_to_float
from agentrl.trajectory import Trajectory

__all__ = ["rescore_trajectory", "rescore_store", "RescoreSummary", "KEPT_REWARD_INFO"]

# reward_info entries written by the agent loop itself, not by the reward function
KEPT_REWARD_INFO = ("tool_rewards", "tool_reward_errors", "interaction_score", "error")
SCORE_ONLY = RewardComponents()


def _judged_text(t: Trajectory) -> str:
    for message in reversed(t.messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def rescore_trajectory(
    t: Trajectory, row: Row | None, reward_fn: Callable, *, reward_name: str, components: RewardComponents = SCORE_ONLY
) -> Trajectory:
    """A copy of ``t`` with the reward of ``reward_fn`` (``reward_info["rescored_with"]`` names it)."""
    extra_info = row.extra_info.model_dump() if row is not None else {}
    reward, info = score_to_float(reward_fn(t.data_source, _judged_text(t), t.ground_truth, extra_info))
    kept = {k: t.reward_info[k] for k in KEPT_REWARD_INFO if k in t.reward_info}
    if not components.is_score_only:
        info["score"] = reward
        reward = components.total(reward, kept.get("tool_rewards", {}), kept.get("interaction_score"))
    return dataclasses.replace(t, reward=reward, reward_info={**info, **kept, "rescored_with": reward_name})


@dataclass(slots=True)
class RescoreSummary:
    trajectories: int = 0
    changed: int = 0  # trajectories whose reward changed
    reward_before: float = 0.0  # sums, divided by ``trajectories`` in ``as_dict``
    reward_after: float = 0.0

    def as_dict(self) -> dict[str, float]:
        n = max(self.trajectories, 1)
        return {"trajectories": self.trajectories, "changed": self.changed,
                "reward_mean_before": self.reward_before / n, "reward_mean_after": self.reward_after / n}


def rescore_store(
    source: RolloutStore, target: RolloutStore, reward: str, *, format_score: float = 0.0,
    where: TrajectoryFilter | None = None, components: RewardComponents = SCORE_ONLY,
) -> RescoreSummary:
    """Write every (matching) shard of ``source`` to ``target`` with new rewards, shard by shard
    (one shard in memory at a time), keeping split, step, writer and stored rows."""
    if source.root.resolve() == target.root.resolve():
        raise DataError("rescore writes a new store: choose an output directory other than the input", file=str(source.root))
    fn = _reward_fn(reward, format_score)
    summary = RescoreSummary()
    written: set[str] = set()
    for path in source.shards(where):
        stored = list(source.iter_shard(path, where))
        if not stored:
            continue
        first = stored[0]
        name = shard_name(first.split, first.step, first.writer_id)
        if name in written or any((s.split, s.step, s.writer_id) != (first.split, first.step, first.writer_id) for s in stored):
            raise DataError("this shard mixes steps or repeats another shard's (split, step, writer); "
                            "rescore keeps one shard per (split, step, writer)", file=str(path))
        written.add(name)
        rescored = [rescore_trajectory(s.trajectory, s.row, fn, reward_name=reward, components=components) for s in stored]
        for s, new in zip(stored, rescored):
            summary.trajectories += 1
            summary.changed += new.reward != s.trajectory.reward
            summary.reward_before += s.trajectory.reward
            summary.reward_after += new.reward
        rows = {s.trajectory.row_id: s.row for s in stored if s.row is not None}
        target.write_step(first.step, rescored, split=first.split, writer_id=first.writer_id, rows=rows,
                          dropped={s.trajectory.group_id: s.dropped for s in stored if s.dropped})  # still untrained
    return summary


def _reward_fn(name: str, format_score: float) -> Callable:
    from agentrl.agent.runner import RewardTable

    table = RewardTable(RewardConfig(default=name, format_score=format_score))
    return table("")  # every data source gets the one function asked for

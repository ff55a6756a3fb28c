"""Which rows need a ground truth: those whose reward compares the answer with one.

A row without ``reward_model.ground_truth`` (or with an empty one) scored by ``gsm8k``,
``gsm8k_flexible`` or ``exact_number`` earns 0 whatever the model answers: the run trains on
noise and says nothing. Such a row is refused at validation. Rows that legitimately have none
pass: a row of an environment (``extra_info.environment``, or the config's ``environment``: it
scores itself), a row run by a loop other than the built-in ones that always call the reward
function (``openai_agent``'s programs may return their own reward, and a plugin loop may set
``episode.own_score``), a row whose data source a plugin package or ``reward.by_data_source``
gives another reward (it may need no ground truth), and any row when ``reward.components.score``
is 0 (the reward function's score does not count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from agentrl.config.schema import RewardConfig
from agentrl.data.row import EnvironmentRef, Row
from agentrl.plugins import ALIASES

__all__ = ["GROUND_TRUTH_REWARDS", "REWARD_FUNCTION_LOOPS", "GroundTruthRule"]

# the built-in rewards (agentrl.rewards) that compare the answer with reward_model.ground_truth
GROUND_TRUTH_REWARDS = frozenset({"gsm8k", "gsm8k_flexible", "exact_number"})
# the built-in loops that always score a trajectory with the reward function
REWARD_FUNCTION_LOOPS = frozenset({"single_turn", "tool_agent", "react"})
_LOOP_ALIASES = ALIASES["agentrl.agent_loops"]


@dataclass(frozen=True, slots=True)
class GroundTruthRule:
    """The run's reward settings, as far as they decide whether a row needs a ground truth:
    ``reward`` (the config's section), ``default_loop`` (``agent.default_loop``: the loop of rows
    without ``agent_name``) and ``declared`` (the data sources a plugin package declares a reward
    for: group ``agentrl.data_source_rewards``)."""

    reward: RewardConfig
    default_loop: str
    declared: Collection[str] = ()

    def problem(self, row: Row, default_environment: EnvironmentRef | None = None) -> str | None:
        """Why ``row`` cannot be scored for want of a ground truth, or None."""
        truth = row.ground_truth
        if truth is not None and truth.strip():
            return None
        if self.reward.components.score == 0 or row.environment_ref(default_environment) is not None:
            return None
        loop = row.agent_name or self.default_loop
        if _LOOP_ALIASES.get(loop, loop) not in REWARD_FUNCTION_LOOPS:
            return None
        source = row.data_source
        if source in self.reward.by_data_source:
            name, key = self.reward.by_data_source[source], f"reward.by_data_source.{source}"
        elif source in self.declared:
            return None
        else:
            name, key = self.reward.default, "reward.default"
        if name not in GROUND_TRUTH_REWARDS:
            return None
        state = "missing" if truth is None else "empty"
        return (f"{state}, but the reward {name!r} ({key}) compares the answer with it: this row would score 0 whatever "
                f"the model answers; give the row its ground truth, or score data source {source!r} with a reward that "
                f"needs none (reward.by_data_source.{source}=NAME)")

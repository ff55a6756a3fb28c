"""Trajectory and TrajectoryBuilder: token versions stay aligned with the tokens."""

from __future__ import annotations

import pytest

from agentrl.errors import TrajectoryError
from agentrl.trajectory import NO_VERSION, Trajectory, TrajectoryBuilder


def test_the_builder_keeps_a_version_per_token_and_none_for_tokens_not_sampled():
    b = TrajectoryBuilder([1, 2])
    b.append_sampled([5, 6], [-0.5, -0.25], versions=[2, 2])
    b.append_sampled([7], [-1.0], extend=True, versions=[3])  # the same turn, resumed after a sync
    b.append_observed([8, 9], "tool")
    b.append_template([10])
    b.append_sampled([11], [-0.125])  # no version known
    assert b.token_versions == [2, 2, 3, NO_VERSION, NO_VERSION, NO_VERSION, NO_VERSION]
    assert len(b.turns) == 3 and b.turns[0].end == 3
    with pytest.raises(TrajectoryError, match=r"sampled ids \(2\) and versions \(1\) differ in length"):
        b.append_sampled([1, 2], [0.0, 0.0], versions=[4])


def test_a_trajectory_whose_versions_do_not_match_its_tokens_is_refused_naming_it():
    with pytest.raises(TrajectoryError, match=r"trajectory r: response_ids \(2\) and token_versions \(1\) must have equal lengths"):
        Trajectory(row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="a", prompt_ids=[1],
                   response_ids=[2, 3], response_mask=[1, 1], logprobs=[0.0, 0.0], turns=[], messages=[],
                   finish_reason="stop", token_versions=[1])


def test_the_oldest_version_counts_sampled_tokens_only_and_falls_back_to_the_metric():
    t = Trajectory(row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="a", prompt_ids=[1],
                   response_ids=[2, 3, 4], response_mask=[0, 1, 1], logprobs=[0.0] * 3, turns=[], messages=[],
                   finish_reason="stop", token_versions=[0, 5, 6], metrics={"weight_version_min": 1.0})
    assert t.oldest_version == 5  # the masked token's entry does not count
    t.token_versions = []
    assert t.oldest_version == 1
    t.metrics = {}
    assert t.oldest_version is None

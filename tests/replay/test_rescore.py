"""Re-scoring changes the rewards and nothing else."""

from __future__ import annotations

import dataclasses
import json

import pytest
from replay_data import call, make_row

from agentrl.errors import DataError
from agentrl.replay.cli import cli_main
from agentrl.replay.rescore import rescore_store
from agentrl.data.rollout_store import RolloutStore, TrajectoryFilter


@pytest.fixture
def loose_answers(rollout, tmp_path):
    """Answers the strict GSM8K rule misses ("408." without ####), one judged by an interaction."""
    rows = [("r0", make_row(index=0)), ("r1", make_row(index=1, interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}))]
    script = {"r0": [call("12 * 34"), "It is 408."], "r1": ["#### 400", "#### 408"]}
    store = RolloutStore(tmp_path / "in")
    store.write_step(0, rollout(script, rows), rows=rows, writer_id=1)
    store.write_step(1, rollout(script, rows), rows=rows, split="val")
    return store


def test_rescore_changes_the_rewards_and_nothing_else(loose_answers, tmp_path):
    before = list(loose_answers.iter_stored())
    assert [s.trajectory.reward for s in before] == [0.0, 1.0, 0.0, 1.0]
    summary = rescore_store(loose_answers, RolloutStore(tmp_path / "out"), "exact_number")
    after = list(RolloutStore(tmp_path / "out").iter_stored())
    assert [s.trajectory.reward for s in after] == [1.0, 1.0, 1.0, 1.0]
    assert summary.as_dict() == {"trajectories": 4, "changed": 2, "reward_mean_before": 0.5, "reward_mean_after": 1.0}
    for old, new in zip(before, after):
        assert (new.split, new.step, new.writer_id, new.row) == (old.split, old.step, old.writer_id, old.row)
        t = new.trajectory
        assert dataclasses.replace(t, reward=old.trajectory.reward, reward_info=old.trajectory.reward_info) == old.trajectory
    assert after[0].trajectory.reward_info == {"strict_format": False, "answer": "408.", "rescored_with": "exact_number"}
    # the interaction's own score is the loop's, not the reward function's: it stays
    assert after[1].trajectory.reward_info == {"strict_format": True, "answer": "408", "interaction_score": 1.0,
                                               "rescored_with": "exact_number"}
    assert after[1].trajectory.turns[0].reward == 0.0 and after[1].trajectory.turns[2].reward == 1.0  # turn rewards kept
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train-step000000-w001.parquet", "val-step000001-w000.parquet"]


def test_rescore_command_composes_the_new_score_with_the_stored_interaction_score(loose_answers, tmp_path):
    """--score-weight 0.5 --interaction-weight 2: r0 (no interaction) 0.5 * 1; r1 0.5 * 1 + 2 * 1."""
    assert cli_main(["rescore", str(loose_answers.root), "--reward", "exact_number", "--output", str(tmp_path / "new"),
                     "--score-weight", "0.5", "--interaction-weight", "2", "--tool-weight", "7"]) == 0
    after = [s.trajectory for s in RolloutStore(tmp_path / "new").iter_stored()]
    assert [t.reward for t in after] == [0.5, 2.5, 0.5, 2.5]  # no tool calc_reward stored: its weight adds nothing
    assert [t.reward_info["score"] for t in after] == [1.0] * 4


def test_rescore_with_filters_writes_only_the_matching_trajectories(loose_answers, tmp_path):
    rescore_store(loose_answers, RolloutStore(tmp_path / "out"), "gsm8k_flexible", where=TrajectoryFilter(split="val"))
    assert [(s.split, s.trajectory.row_id) for s in RolloutStore(tmp_path / "out").iter_stored()] == [("val", "r0"), ("val", "r1")]


def test_rescore_refuses_to_overwrite_its_input(loose_answers):
    with pytest.raises(DataError, match="choose an output directory other than the input"):
        rescore_store(loose_answers, RolloutStore(loose_answers.root), "gsm8k")


def test_rescore_command_prints_the_summary_and_the_new_store(loose_answers, tmp_path, capsys):
    assert cli_main(["rescore", str(loose_answers.root), "--reward", "exact_number", "--output", str(tmp_path / "new"),
                     "--step", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"rescored store: {tmp_path / 'new'}"
    assert json.loads("\n".join(out[:-1])) == {"trajectories": 2, "changed": 1, "reward_mean_before": 0.5, "reward_mean_after": 1.0}


def test_rescore_with_an_unknown_reward_names_it(loose_answers, tmp_path, capsys):
    assert cli_main(["rescore", str(loose_answers.root), "--reward", "no_such_reward", "--output", str(tmp_path / "x")]) == 2
    assert "no_such_reward" in capsys.readouterr().err

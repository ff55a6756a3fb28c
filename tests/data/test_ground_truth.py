"""A row whose reward compares the answer with a ground truth is refused without one; rows that
are scored otherwise (environments, self-scoring loops, other rewards) are not."""

from __future__ import annotations

import pytest
from test_dataset import make_rows

from agentrl.config.schema import AgentConfig, DataConfig, RewardComponents, RewardConfig, TrainConfig
from agentrl.data.cli import cli_main
from agentrl.data.dataset import validate_files
from agentrl.data.ground_truth import GroundTruthRule
from agentrl.data.io import write_rows
from agentrl.data.prepare import prepare_data
from agentrl.data.row import EnvironmentRef
from agentrl.errors import DataError

MISSING = ("missing, but the reward 'gsm8k' (reward.default) compares the answer with it: this row would score 0 whatever "
           "the model answers; give the row its ground truth, or score data source 'test/arith' with a reward that "
           "needs none (reward.by_data_source.test/arith=NAME)")


def rows_without_truth(n=4):
    rows = make_rows(n)
    for row in rows:
        row["reward_model"]["ground_truth"] = None
    return rows


def problems(path, rule, **kwargs):
    return [(p.row, p.field, p.message) for p in validate_files([path], ground_truth=rule, **kwargs)]


def test_a_row_without_the_ground_truth_its_reward_needs_is_refused_naming_file_row_and_field(tmp_path):
    rows = make_rows(4)
    rows[1]["reward_model"]["ground_truth"] = None
    rows[3]["reward_model"]["ground_truth"] = "  "
    path = write_rows(rows, tmp_path / "train.parquet")
    [missing, empty] = validate_files([path], ground_truth=GroundTruthRule(RewardConfig(), "single_turn"))
    assert str(missing) == f"file {path}, row 1, field reward_model.ground_truth: {MISSING}"
    assert (empty.row, empty.field, empty.message) == (3, "reward_model.ground_truth", MISSING.replace("missing", "empty", 1))
    assert validate_files([path]) == []  # without the run's reward settings nothing is known about the reward


def test_rows_scored_without_a_ground_truth_pass(tmp_path):
    rows = rows_without_truth()
    rows[0]["agent_name"] = "openai_agent"  # a program may return its own reward
    rows[0]["extra_info"]["agent_program"] = "gsm8k_calculator"
    rows[1]["extra_info"]["environment"] = {"library": "verifiers", "name": "wordle"}  # the environment scores it
    rows[2]["data_source"] = "judged/by_a_plugin"
    rows[3]["data_source"] = "judged/by_config"
    path = write_rows(rows, tmp_path / "rows.parquet")
    rule = GroundTruthRule(RewardConfig(by_data_source={"judged/by_config": "my_judge"}), "single_turn",
                           declared={"judged/by_a_plugin"})
    assert problems(path, rule) == []
    # the same rows under the default reward: the two data sources need a ground truth now
    assert [row for row, _, _ in problems(path, GroundTruthRule(RewardConfig(), "single_turn"))] == [2, 3]
    # a configured exact_number for one of them names where it comes from
    rule = GroundTruthRule(RewardConfig(default="my_judge", by_data_source={"judged/by_config": "exact_number"}), "single_turn")
    [(row, _, message)] = problems(path, rule)
    assert row == 3 and message.startswith("missing, but the reward 'exact_number' (reward.by_data_source.judged/by_config)")


def test_the_config_decides_environment_loop_and_whether_the_score_counts(tmp_path):
    rows = rows_without_truth(2)
    for row in rows:
        del row["agent_name"]
    path = write_rows(rows, tmp_path / "rows.parquet")
    assert [row for row, _, _ in problems(path, GroundTruthRule(RewardConfig(), "single_turn"))] == [0]  # row 1: the same
    assert problems(path, GroundTruthRule(RewardConfig(), "my_scoring_loop")) == []
    assert problems(path, GroundTruthRule(RewardConfig(components=RewardComponents(score=0.0, tool_calc_reward=1.0)), "tool_agent")) == []
    openenv = EnvironmentRef(library="openenv", name="echo")
    assert problems(path, GroundTruthRule(RewardConfig(), "single_turn"), default_environment=openenv) == []


def test_train_and_data_validate_refuse_the_row_and_validate_takes_the_reward_to_check_against(tmp_path, capsys):
    rows = make_rows(3)
    rows[2]["reward_model"]["ground_truth"] = None
    path = write_rows(rows, tmp_path / "train.parquet")
    with pytest.raises(DataError) as refused:
        prepare_data(TrainConfig(data=DataConfig(train_files=[str(path)]), agent=AgentConfig()), tmp_path)
    assert str(refused.value) == f"invalid data (1 problem):\n  file {path}, row 2, field reward_model.ground_truth: {MISSING}"
    assert cli_main(["validate", str(path)]) == 1
    assert capsys.readouterr().out == f"file {path}, row 2, field reward_model.ground_truth: {MISSING}\n"
    assert cli_main(["validate", str(path), "--reward", "my_judge"]) == 0
    assert capsys.readouterr().out == "3 rows in 1 file: all valid\n"

"""Rows load validated, in pieces, in a seeded order that resumes exactly."""

from __future__ import annotations

import pytest

from agentrl.data.dataset import RowDataset, rows_from_dicts, validate_files
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.errors import DataError
from agentrl_data_prep.tasks import generate


def rows(n, **overrides):
    out = generate("arith", n, seed=0)
    for r in out:
        r.update(overrides)
    return out


@pytest.fixture
def data_file(tmp_path):
    return write_rows(rows(40), tmp_path / "train.parquet", row_group_size=8)


def test_round_trip_keeps_tools_and_interaction_kwargs(tmp_path):
    source = generate("arith_retry", 3, seed=1)
    source[0]["extra_info"]["tools_kwargs"] = {"check_answer": {"create_kwargs": {"ground_truth": "7"}}}
    path = write_rows(source, tmp_path / "r.parquet")
    back = [raw for _, raw in iter_raw_rows(path)]
    assert back[0]["extra_info"]["tools_kwargs"] == {"check_answer": {"create_kwargs": {"ground_truth": "7"}}}
    assert back[1]["extra_info"]["interaction_kwargs"] == source[1]["extra_info"]["interaction_kwargs"]
    [(uid, row)] = rows_from_dicts(back[:1])
    assert uid == "agentrl/arith_retry:0"
    assert row.extra_info.tools_kwargs["check_answer"].create_kwargs == {"ground_truth": "7"}


def test_invalid_row_names_file_row_and_field(tmp_path):
    bad = rows(5)
    bad[3]["prompt"][1]["role"] = "robot"
    path = write_rows(bad, tmp_path / "bad.parquet")
    [problem] = validate_files([path])
    assert (problem.file, problem.row, problem.field) == (str(path), 3, "prompt.1.role")
    assert str(problem).startswith(f"file {path}, row 3, field prompt.1.role: Input should be")


def test_every_bad_row_is_reported_at_once(tmp_path):
    bad = rows(6)
    bad[1]["data_source"] = None
    bad[4]["prompt"] = []
    path = write_rows(bad, tmp_path / "bad.parquet")
    problems = validate_files([path, tmp_path / "missing.parquet"])
    assert [(p.row, p.field) for p in problems[:2]] == [(1, "data_source"), (4, "prompt")]
    assert str(problems[2]) == f"file {tmp_path / 'missing.parquet'}: file not found"


def test_unknown_agent_name_is_reported_at_load(tmp_path):
    from agentrl.agent.runner import check_agent_names

    path = write_rows(rows(3, agent_name="planner"), tmp_path / "a.parquet")
    [problem] = validate_files([path], check_agent_names=check_agent_names)
    assert problem.field == "agent_name" and problem.row == 0
    assert "unknown agent_name 'planner'" in str(problem)


def test_shuffle_is_seeded_and_changes_each_epoch(data_file):
    a = RowDataset([data_file], batch_size=8, seed=3)
    b = RowDataset([data_file], batch_size=8, seed=3)
    first = [[uid for uid, _ in a.next_batch()] for _ in range(10)]
    assert first == [[uid for uid, _ in b.next_batch()] for _ in range(10)]
    epoch0, epoch1 = sum(first[:5], []), sum(first[5:], [])
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 40
    assert epoch0 != epoch1
    c = RowDataset([data_file], batch_size=8, seed=4)
    assert [uid for uid, _ in c.next_batch()] != first[0]


def test_resume_gives_the_same_following_batches(data_file):
    straight = RowDataset([data_file], batch_size=8, seed=1)
    expected = [[uid for uid, _ in straight.next_batch()] for _ in range(9)]
    first = RowDataset([data_file], batch_size=8, seed=1)
    for _ in range(6):
        first.next_batch()
    resumed = RowDataset([data_file], batch_size=8, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert [[uid for uid, _ in resumed.next_batch()] for _ in range(3)] == expected[6:]


def test_resume_refuses_a_position_from_other_data(data_file, tmp_path):
    other = write_rows(rows(16), tmp_path / "other.parquet")
    state = RowDataset([data_file], batch_size=8).state_dict()
    with pytest.raises(DataError, match="cannot resume: the saved position is for 40 rows"):
        RowDataset([other], batch_size=8).load_state_dict(state)


def test_batches_read_row_groups_not_whole_files(data_file):
    dataset = RowDataset([data_file], batch_size=4, shuffle=False, cache_row_groups=1)
    dataset.next_batch()
    assert dataset.reads == 1  # 4 rows from the first of five row groups of 8


def test_rows_across_several_files(tmp_path):
    a = write_rows(rows(5), tmp_path / "a.parquet")
    b = write_rows(generate("word", 5, seed=0), tmp_path / "b.parquet")
    dataset = RowDataset([a, b], batch_size=10, shuffle=False)
    sources = [row.data_source for _, row in dataset.next_batch()]
    assert sources == ["agentrl/arith"] * 5 + ["agentrl/word"] * 5

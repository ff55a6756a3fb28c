"""Rows load validated, in pieces, in a seeded order that resumes exactly."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.data.dataset import RowDataset, rows_from_dicts, validate_files
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.errors import DataError

LOOPS = {"single_turn", "tool_agent", "single_turn_agent"}


def make_rows(n, *, source="test/arith", start=0, **overrides):
    rows = []
    for i in range(start, start + n):
        rows.append({
            "data_source": source,
            "prompt": [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": f"What is {i} + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train", "tools_kwargs": {"calculator": {"create_kwargs": {}}}},
            "agent_name": "tool_agent",
            **overrides,
        })
    return rows


def uids(batch):
    return [uid for uid, _ in batch]


@pytest.fixture
def data_file(tmp_path):
    return write_rows(make_rows(40), tmp_path / "train.parquet", row_group_size=8)


# ---------------------------------------------------------------- the file format


def test_rows_with_different_tools_kwargs_keys_round_trip(tmp_path):
    source = make_rows(3)
    source[0]["extra_info"]["tools_kwargs"] = {"check_answer": {"create_kwargs": {"ground_truth": "7", "tolerance": 0.5}}}
    source[1]["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {}}, "search": {"create_kwargs": {"top_k": [1, 2]}}}
    source[2]["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "query": "q", "ground_truth": "3"}
    path = write_rows(source, tmp_path / "r.parquet")
    back = [raw for _, raw in iter_raw_rows(path)]
    assert [r["extra_info"].get("tools_kwargs") for r in back] == [r["extra_info"]["tools_kwargs"] for r in source]
    assert back[2]["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", "query": "q", "ground_truth": "3"}
    assert "interaction_kwargs" not in back[0]["extra_info"]  # absent where the source had none
    [(uid, row), *_] = rows_from_dicts(back)
    assert uid == "test/arith:0"
    assert row.extra_info.tools_kwargs["check_answer"].create_kwargs == {"ground_truth": "7", "tolerance": 0.5}


def test_a_column_only_later_rows_have_is_kept(tmp_path):
    source = make_rows(2)
    del source[0]["agent_name"]
    source[1]["prompt"][1]["name"] = "alice"
    path = write_rows(source, tmp_path / "r.parquet")
    back = [raw for _, raw in iter_raw_rows(path)]
    assert [r["agent_name"] for r in back] == [None, "tool_agent"]
    assert back[0]["prompt"][1] == {"role": "user", "content": "What is 0 + 1?"}
    assert back[1]["prompt"][1] == {"role": "user", "content": "What is 1 + 1?", "name": "alice"}


def test_verl_struct_kwargs_are_read_like_json_ones(tmp_path):
    # how verl's preprocessing stores them: nested structs, merged across rows by Arrow
    table = pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q0"}],
         "reward_model": {"style": "rule", "ground_truth": "72"},
         "extra_info": {"index": 0, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}},
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q1"}],
         "reward_model": {"style": "rule", "ground_truth": "5"},
         "extra_info": {"index": 1, "interaction_kwargs": {"name": "gsm8k", "query": "q1", "ground_truth": "5"}}},
    ])
    path = tmp_path / "verl.parquet"
    pq.write_table(table, path)
    assert validate_files([path]) == []
    dataset = RowDataset([path], batch_size=2, shuffle=False)
    (_, first), (_, second) = dataset.next_batch()
    assert first.extra_info.tools_kwargs["calc_gsm8k_reward"].create_kwargs == {"ground_truth": "72"}
    assert first.extra_info.interaction_kwargs is None
    assert second.extra_info.tools_kwargs == {} and second.extra_info.interaction_kwargs.name == "gsm8k"


def test_a_column_arrow_cannot_store_is_named(tmp_path):
    rows = make_rows(2)
    rows[1]["reward_model"]["ground_truth"] = ["7"]
    with pytest.raises(DataError, match=r"column reward_model: cannot mix list and non-list"):
        write_rows(rows, tmp_path / "mixed.parquet")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- validation


def test_invalid_row_names_file_row_and_field(tmp_path):
    bad = make_rows(5)
    bad[3]["prompt"][1]["role"] = "robot"
    path = write_rows(bad, tmp_path / "bad.parquet")
    [problem] = validate_files([path])
    assert (problem.file, problem.row, problem.field) == (str(path), 3, "prompt.1.role")
    assert str(problem) == (f"file {path}, row 3, field prompt.1.role: Input should be 'system', 'user', 'assistant' or 'tool' "
                            "(got 'robot')")


def test_a_bad_value_is_echoed_shortened_and_a_missing_field_has_none_to_echo(tmp_path):
    rows = make_rows(2)
    rows[0]["prompt"][0]["role"] = "r" * 200
    rows[1]["data_source"] = None
    long, null = validate_files([write_rows(rows, tmp_path / "bad.parquet")])
    assert long.message.endswith(f"(got '{'r' * 76}...)")
    assert (null.field, null.message) == ("data_source", "Input should be a valid string (got None)")
    del rows[1]["data_source"]
    with pytest.raises(DataError) as missing:
        rows_from_dicts(rows[1:])
    assert (missing.value.field, missing.value.message) == ("data_source", "Field required")


def test_reading_an_invalid_row_raises_naming_file_row_and_field(tmp_path):
    bad = make_rows(6)
    bad[5]["prompt"][0]["role"] = "narrator"
    path = write_rows(bad, tmp_path / "bad.parquet", row_group_size=4)
    dataset = RowDataset([path], batch_size=3, shuffle=False)
    assert len(dataset.next_batch()) == 3
    with pytest.raises(DataError) as caught:
        dataset.next_batch()
    assert (caught.value.file, caught.value.row, caught.value.field) == (str(path), 5, "prompt.0.role")


def test_every_bad_row_is_reported_at_once(tmp_path):
    bad = make_rows(6)
    bad[1]["data_source"] = None
    bad[4]["prompt"] = []
    path = write_rows(bad, tmp_path / "bad.parquet")
    missing = tmp_path / "missing.parquet"
    problems = validate_files([path, missing])
    assert [(p.file, p.row, p.field) for p in problems] == [(str(path), 1, "data_source"), (str(path), 4, "prompt"), (str(missing), None, None)]
    assert str(problems[2]) == f"file {missing}: file not found"


def test_the_problem_list_is_capped_and_says_how_many_were_left_out(tmp_path):
    bad = [{**row, "agent_name": f"planner{i}"} for i, row in enumerate(make_rows(8))]
    path = write_rows(bad, tmp_path / "bad.parquet")
    problems = validate_files([path], known_agent_names=LOOPS, max_reported=3)
    assert [p.row for p in problems[:3]] == [0, 1, 2]
    assert str(problems[3]) == "... and 5 more problems (only the first 3 are listed)"


def test_a_problem_every_row_has_is_listed_once_with_its_rows(tmp_path):
    bad = make_rows(8, agent_name="planner")
    bad[3]["agent_name"] = "critic"
    path = write_rows(bad, tmp_path / "bad.parquet")
    problems = validate_files([path], known_agent_names=LOOPS, max_reported=3)
    assert [(p.row, p.field) for p in problems] == [(0, "agent_name"), (3, "agent_name")]
    assert str(problems[0]).endswith(f"(the same in rows 1, 2, 4, 5, 6 and 1 more of {path})")
    assert problems[0].message.startswith("unknown agent_name 'planner'") and "the same in" not in str(problems[1])


def test_counts_of_one_are_singular_in_every_message(tmp_path):
    from agentrl.config.schema import DataConfig, TrainConfig
    from agentrl.data.prepare import prepare_data

    rows = make_rows(3)
    rows[0]["data_source"], rows[0]["prompt"][0]["role"] = None, "robot"  # two problems in one row
    rows[1]["agent_name"] = "planner1"
    rows[2]["agent_name"] = "planner2"
    path = write_rows(rows, tmp_path / "bad.parquet")
    first, second, rest = validate_files([path], known_agent_names=LOOPS, max_reported=2)
    assert first.message.endswith("(and 1 more problem in this row)")
    assert str(rest) == "... and 1 more problem (only the first 2 are listed)"
    del rows[1]["agent_name"]
    [unknown] = validate_files([write_rows(rows[1:2], tmp_path / "one.parquet")], known_agent_names=LOOPS, default_agent="planner")
    assert unknown.message.endswith("; 1 row has no agent_name")
    with pytest.raises(DataError, match=r": 1 row cannot fill one batch of 2$"):
        RowDataset([tmp_path / "one.parquet"], batch_size=2)
    with pytest.raises(DataError) as caught:
        prepare_data(TrainConfig(data=DataConfig(train_files=[str(write_rows(rows[2:], tmp_path / "two.parquet"))])), tmp_path)
    assert str(caught.value).startswith("invalid data (1 problem):\n  file ")


def test_a_file_given_as_training_and_validation_data_is_checked_once_and_a_repeated_problem_names_its_file(tmp_path):
    from agentrl.config.schema import DataConfig, TrainConfig
    from agentrl.data.prepare import prepare_data

    rows = make_rows(4)
    for i in (1, 3):
        rows[i]["prompt"][1]["role"] = "robot"
    path = str(write_rows(rows, tmp_path / "both.parquet"))
    with pytest.raises(DataError) as caught:
        prepare_data(TrainConfig(data=DataConfig(train_files=[path], val_files=[path])), tmp_path)
    assert str(caught.value) == (f"invalid data (1 problem):\n  file {path}, row 1, field prompt.1.role: Input should be 'system', "
                                 f"'user', 'assistant' or 'tool' (got 'robot') (the same in row 3 of {path})")


def test_unknown_agent_name_is_reported_at_load(tmp_path):
    rows = make_rows(3)
    rows[1]["agent_name"] = "planner"
    path = write_rows(rows, tmp_path / "a.parquet")
    [problem] = validate_files([path], known_agent_names=LOOPS)
    assert (problem.row, problem.field) == (1, "agent_name")
    assert str(problem).endswith("unknown agent_name 'planner' (known: single_turn, single_turn_agent, tool_agent)")


def test_rows_without_agent_name_are_checked_against_the_default_agent(tmp_path):
    rows = make_rows(4)
    for r in rows[1:]:
        del r["agent_name"]
    path = write_rows(rows, tmp_path / "a.parquet")
    assert validate_files([path], known_agent_names=LOOPS, default_agent="tool_agent") == []
    [problem] = validate_files([path], known_agent_names=LOOPS, default_agent="planner")
    assert (problem.row, problem.field) == (1, "agent_name")
    assert "the default agent 'planner' is unknown" in str(problem) and "3 rows have no agent_name" in str(problem)


def test_the_agent_check_uses_the_installed_loops(tmp_path):
    from agentrl.data.cli import known_agent_names

    names = known_agent_names()
    assert {"single_turn", "tool_agent", "single_turn_agent"} <= names
    path = write_rows(make_rows(2, agent_name="single_turn_agent"), tmp_path / "a.parquet")
    assert validate_files([path], known_agent_names=names) == []


def test_a_missing_file_is_named_when_the_dataset_opens(tmp_path):
    with pytest.raises(DataError, match=f"file {tmp_path / 'nope.parquet'}: file not found"):
        RowDataset([tmp_path / "nope.parquet"], batch_size=2)


# ---------------------------------------------------------------- order and resumption


def test_shuffle_is_seeded_and_changes_each_epoch(data_file):
    a = RowDataset([data_file], batch_size=8, seed=3)
    b = RowDataset([data_file], batch_size=8, seed=3)
    first = [uids(a.next_batch()) for _ in range(10)]
    assert first == [uids(b.next_batch()) for _ in range(10)]
    epoch0, epoch1 = sum(first[:5], []), sum(first[5:], [])
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"test/arith:{i}" for i in range(40))
    assert epoch0 != epoch1
    assert uids(RowDataset([data_file], batch_size=8, seed=4).next_batch()) != first[0]


def test_the_order_of_a_seed_is_pinned(data_file):
    # a changed order would silently change what a resumed run trains on next
    assert uids(RowDataset([data_file], batch_size=6, seed=0).next_batch()) == [f"test/arith:{i}" for i in (4, 16, 21, 5, 11, 14)]
    assert uids(RowDataset([data_file], batch_size=6, seed=7).next_batch()) == [f"test/arith:{i}" for i in (13, 28, 14, 18, 12, 0)]


def test_unshuffled_batches_follow_the_files_and_keep_a_short_last_batch(tmp_path):
    a = write_rows(make_rows(5), tmp_path / "a.parquet", row_group_size=2)
    b = write_rows(make_rows(3, source="test/word"), tmp_path / "b.parquet")
    dataset = RowDataset([a, b], batch_size=3, shuffle=False, drop_last=False)
    assert len(dataset) == 3
    batches = [uids(dataset.next_batch()) for _ in range(4)]
    assert batches == [
        ["a/test/arith:0", "a/test/arith:1", "a/test/arith:2"],
        ["a/test/arith:3", "a/test/arith:4", "b/test/word:0"],
        ["b/test/word:1", "b/test/word:2"],
        ["a/test/arith:0", "a/test/arith:1", "a/test/arith:2"],
    ]


def test_rows_come_back_as_written(data_file):
    dataset = RowDataset([data_file], batch_size=8, seed=0)
    for uid, row in dataset.next_batch():
        i = int(uid.split(":")[1])
        assert row.prompt[1].content == f"What is {i} + 1?" and row.ground_truth == str(i + 1)


def test_row_uid_falls_back_to_file_stem_and_row_number(tmp_path):
    rows = make_rows(3)
    for r in rows:
        del r["extra_info"]["index"]
    path = write_rows(rows, tmp_path / "noindex.parquet")
    assert uids(RowDataset([path], batch_size=3, shuffle=False).next_batch()) == ["noindex:0", "noindex:1", "noindex:2"]


def test_resume_gives_the_same_following_batches(data_file):
    straight = RowDataset([data_file], batch_size=8, seed=1)
    expected = [uids(straight.next_batch()) for _ in range(9)]
    first = RowDataset([data_file], batch_size=8, seed=1)
    for _ in range(6):  # into the second epoch
        first.next_batch()
    state = first.state_dict()
    assert state == {"epoch": 1, "offset": 8, "seed": 1, "num_rows": 40}
    resumed = RowDataset([data_file], batch_size=8, seed=1)
    resumed.load_state_dict(state)
    assert [uids(resumed.next_batch()) for _ in range(3)] == expected[6:]


def test_resume_refuses_a_position_from_other_data(data_file, tmp_path):
    other = write_rows(make_rows(16), tmp_path / "other.parquet")
    state = RowDataset([data_file], batch_size=8).state_dict()
    with pytest.raises(DataError, match="cannot resume: the saved position is for 40 rows"):
        RowDataset([other], batch_size=8).load_state_dict(state)


def test_a_pickled_dataset_continues_where_it_was(data_file):
    dataset = RowDataset([data_file], batch_size=8, seed=2)
    dataset.next_batch()
    copy = pickle.loads(pickle.dumps(dataset))
    assert uids(copy.next_batch()) == uids(dataset.next_batch())


# ---------------------------------------------------------------- reading in pieces


def test_a_shuffled_batch_decodes_only_the_row_groups_it_needs(tmp_path, monkeypatch):
    path = write_rows(make_rows(2000), tmp_path / "big.parquet", row_group_size=50)  # 40 row groups
    groups_read = []
    real = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        groups_read.append(i)
        return real(self, i, *args, **kwargs)

    def whole_file(*args, **kwargs):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
    monkeypatch.setattr(pq, "read_table", whole_file)
    dataset = RowDataset([path], batch_size=4, seed=0)
    batch = dataset.next_batch()
    expected = sorted({int(uid.split(":")[1]) // 50 for uid in uids(batch)})
    assert sorted(groups_read) == expected and len(groups_read) <= 4
    assert dataset.reads == len(groups_read)


def test_the_row_group_cache_stays_within_its_byte_budget(tmp_path):
    path = write_rows(make_rows(400), tmp_path / "big.parquet", row_group_size=20)
    one_group = pq.ParquetFile(path).read_row_group(0).nbytes
    dataset = RowDataset([path], batch_size=10, seed=0, cache_bytes=3 * one_group + 100)
    for _ in range(40):  # a full epoch
        dataset.next_batch()
        assert 1 <= len(dataset._cache) <= 3
    assert dataset.reads > 20  # groups were evicted and read again, not all kept


def test_a_row_group_larger_than_the_cache_is_refused_with_a_fix(tmp_path):
    path = write_rows(make_rows(200), tmp_path / "one_group.parquet", row_group_size=200)
    with pytest.raises(DataError, match=r"row group 0 holds 200 rows .* rewrite the file with smaller row groups"):
        RowDataset([path], batch_size=2, cache_bytes=1000)


def test_rows_naming_tools_or_interactions_that_are_not_known_are_reported_with_their_field(tmp_path):
    rows = make_rows(3)
    rows[1]["extra_info"]["tools_kwargs"]["telescope"] = {"create_kwargs": {}}
    rows[2]["extra_info"]["interaction_kwargs"] = {"name": "oracle"}
    path = write_rows(rows, tmp_path / "a.parquet")
    assert validate_files([path]) == []  # nothing known given: nothing checked
    problems = validate_files([path], known_tools={"calculator"}, known_interactions={"gsm8k"})
    assert [(p.row, p.field) for p in problems] == [(1, "extra_info.tools_kwargs.telescope"), (2, "extra_info.interaction_kwargs.name")]
    assert str(problems[0]).endswith("unknown tool 'telescope' (known: calculator)")
    assert str(problems[1]).endswith("unknown interaction 'oracle' (known: gsm8k)")


def test_data_validate_cli_names_an_uninstalled_tool_and_exits_1(tmp_path, capsys):
    from agentrl.data.cli import cli_main

    rows = make_rows(2)
    rows[1]["extra_info"]["tools_kwargs"]["telescope"] = {"create_kwargs": {}}
    path = write_rows(rows, tmp_path / "a.parquet")
    assert cli_main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "row 1" in out and "extra_info.tools_kwargs.telescope" in out and "unknown tool 'telescope'" in out
    rows[1]["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {}}}
    assert cli_main(["validate", str(write_rows(rows, tmp_path / "b.parquet"))]) == 0


def test_a_row_naming_an_uninstalled_agent_program_is_refused_by_validate_rollout_and_train(tmp_path, capsys):
    from agentrl.config.schema import DataConfig, TrainConfig
    from agentrl.data.cli import cli_main
    from agentrl.data.prepare import prepare_data

    rows = make_rows(3)
    for i, program in enumerate(["gsm8k_calculator", "gsm8k_calculater", "gsm8k_calculator_agents_sdk"]):
        rows[i]["agent_name"], rows[i]["extra_info"]["agent_program"] = "openai_agent", program
    path = write_rows(rows, tmp_path / "a.parquet")
    assert cli_main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert (f"file {path}, row 1, field extra_info.agent_program: unknown agent program 'gsm8k_calculater' "
            "(known: gsm8k_calculator, gsm8k_calculator_agents_sdk, gsm8k_calculator_compact)") in out
    assert "row 0" not in out and "row 2" not in out
    # agentrl train and agentrl rollout read their data through prepare_data: refused before any compute
    with pytest.raises(DataError, match=r"row 1, field extra_info.agent_program: unknown agent program 'gsm8k_calculater'"):
        prepare_data(TrainConfig(data=DataConfig(train_files=[str(path)])), tmp_path)
    rows[1]["extra_info"]["agent_program"] = "gsm8k_calculator_compact"
    assert cli_main(["validate", str(write_rows(rows, tmp_path / "b.parquet"))]) == 0


def test_interaction_kwargs_without_a_name_are_accepted_as_verls_rows_write_them(tmp_path):
    rows = make_rows(1)
    rows[0]["extra_info"]["interaction_kwargs"] = {"query": "What is 1 + 1?", "ground_truth": "2"}
    path = write_rows(rows, tmp_path / "a.parquet")
    assert validate_files([path], known_interactions={"gsm8k"}) == []
    [(_, row)] = list(RowDataset([path], batch_size=1, shuffle=False).next_batch())
    assert row.extra_info.interaction_kwargs.name is None
    assert row.extra_info.interaction_kwargs.model_extra == {"query": "What is 1 + 1?", "ground_truth": "2"}


def test_rows_of_several_files_get_distinct_uids_even_when_each_file_indexes_from_0(tmp_path):
    a = write_rows(make_rows(2), tmp_path / "plain.parquet")
    b = write_rows(make_rows(2), tmp_path / "tool.parquet")
    (tmp_path / "x").mkdir()
    c = write_rows(make_rows(1), tmp_path / "x" / "tool.parquet")
    assert uids(RowDataset([a], batch_size=2, shuffle=False).next_batch()) == ["test/arith:0", "test/arith:1"]  # one file: as before
    both = RowDataset([a, b], batch_size=4, shuffle=False).next_batch()
    assert uids(both) == ["plain/test/arith:0", "plain/test/arith:1", "tool/test/arith:0", "tool/test/arith:1"]
    same_stem = RowDataset([b, c], batch_size=3, shuffle=False).next_batch()
    assert uids(same_stem) == ["0.tool/test/arith:0", "0.tool/test/arith:1", "1.tool/test/arith:0"]


def damaged(data_file, how: str):
    raw = data_file.read_bytes()
    if how == "truncated":  # the footer (schema, row groups) is gone
        data_file.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        data_file.write_bytes(b"")
    else:  # the footer is intact, the first row group's first page header is garbage
        data_file.write_bytes(raw[:4] + bytes(255 - b for b in raw[4:68]) + raw[68:])
    return data_file


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_a_truncated_parquet_file_is_a_data_error_naming_it(data_file, how):
    damaged(data_file, how)
    for load in (lambda: RowDataset([str(data_file)], batch_size=4, seed=0), lambda: list(iter_raw_rows(data_file))):
        with pytest.raises(DataError, match="not a readable parquet file") as caught:
            load()
        assert caught.value.file == str(data_file)
    # validation collects its problems instead of raising
    [problem] = validate_files([str(data_file)], known_agent_names=LOOPS)
    assert problem.file == str(data_file) and "not a readable parquet file" in str(problem)


def test_a_corrupt_row_group_is_a_data_error_naming_the_file(data_file):
    """The footer still opens; the damage shows when the rows are read, and the error says where."""
    dataset_before = RowDataset([str(data_file)], batch_size=4, seed=0)
    damaged(data_file, "corrupt")
    dataset = RowDataset([str(data_file)], batch_size=4, seed=0)
    assert len(dataset) == len(dataset_before)
    with pytest.raises(DataError) as caught:
        for index in range(len(dataset)):
            dataset.row(index)
    assert caught.value.file == str(data_file)
    assert str(data_file) in str(caught.value)

"""Row files in JSON (.jsonl, .json) are read like parquet ones: the same schema, the same
validation, problems naming the file, the row, its line and the field."""

from __future__ import annotations

import functools
import json

import pytest

from agentrl.data.cli import cli_main
from agentrl.data.dataset import RowDataset, validate_files
from agentrl.data.io import JsonRows, count_rows, iter_raw_rows, write_rows
from agentrl.errors import DataError

from test_dataset import LOOPS, make_rows


def jsonl(path, rows, *, blank_after: int | None = None):
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after + 1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_jsonl_file_validates_and_loads_like_the_same_rows_in_parquet(tmp_path, capsys, monkeypatch):
    rows = make_rows(5)
    rows[2]["extra_info"]["tools_kwargs"] = json.dumps({"check_answer": {"create_kwargs": {"ground_truth": "3"}}})  # as write_rows stores it
    path = jsonl(tmp_path / "train.jsonl", rows, blank_after=1)
    assert validate_files([path], known_agent_names=LOOPS) == [] and count_rows(path) == 5
    parquet = write_rows(rows, tmp_path / "train.parquet")
    assert [raw for _, raw in iter_raw_rows(path)] == [raw for _, raw in iter_raw_rows(parquet)]
    # groups of 2 rows and a cache that keeps one: rows are read back from their offsets again and again
    monkeypatch.setattr("agentrl.data.dataset.JsonRows", functools.partial(JsonRows, group_size=2))
    dataset = RowDataset([path], batch_size=2, shuffle=True, seed=1, drop_last=False, cache_bytes=1)
    again = RowDataset([parquet], batch_size=2, shuffle=True, seed=1, drop_last=False)
    assert [dataset.next_batch() for _ in range(6)] == [again.next_batch() for _ in range(6)]
    assert dataset.reads >= 6 and len(dataset._cache) == 1  # noqa: SLF001
    assert cli_main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "5 rows in 1 file: all valid"


def test_a_json_array_of_rows_is_read_too(tmp_path):
    path = tmp_path / "val.json"
    path.write_text(json.dumps(make_rows(3)))
    assert [raw["data_source"] for _, raw in iter_raw_rows(path)] == ["test/arith"] * 3
    assert [uid for uid, _ in RowDataset([path], batch_size=3, shuffle=False).next_batch()] == [
        "test/arith:0", "test/arith:1", "test/arith:2"]


def test_a_bad_jsonl_file_names_each_problems_row_line_and_field(tmp_path, capsys):
    rows = make_rows(4)
    rows[1]["prompt"][0]["role"] = "robot"
    path = jsonl(tmp_path / "bad.jsonl", rows, blank_after=0)  # line 2 is blank: row 1 is on line 3
    text = path.read_text().splitlines()
    text[3] = text[3][:-1]  # row 2 (line 4) cut short
    text[4] = "[1, 2]"  # row 3 (line 5) not an object
    path.write_text("\n".join(text) + "\n")
    problems = validate_files([path], known_agent_names=LOOPS)
    assert [str(p) for p in problems] == [
        f"file {path}, row 1 (line 3), field prompt.0.role: Input should be 'system', 'user', 'assistant' or 'tool' (got 'robot')",
        f"file {path}, row 2 (line 4): not valid JSON (Expecting ',' delimiter at column 346); "
        "a JSON Lines file holds one row object a line",
    ]
    assert cli_main(["validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[0].startswith(f"file {path}, row 1 (line 3), field prompt.0.role:")
    path.write_text(path.read_text().replace(text[3] + "\n", ""))  # row 2 is now the array, on line 4
    [_, not_object] = validate_files([path])
    assert str(not_object) == f"file {path}, row 2 (line 4): a row must be a JSON object, got list"
    dataset = RowDataset([path], batch_size=1, shuffle=False)
    assert dataset.next_batch()[0][0] == "test/arith:0"
    with pytest.raises(DataError, match=r"row 1 \(line 3\), field prompt.0.role: .*\(got 'robot'\)"):
        dataset.next_batch()


def test_a_file_that_is_neither_parquet_nor_json_says_which_formats_are_read(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("data_source,prompt\n")
    [problem] = validate_files([path])
    assert problem.message.startswith("not a readable parquet file: ")
    assert problem.message.endswith("(row files are parquet, or JSON Lines named .jsonl or .json)")
    [missing] = validate_files([tmp_path / "nope.jsonl"])
    assert str(missing) == f"file {tmp_path / 'nope.jsonl'}: file not found"

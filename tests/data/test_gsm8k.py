"""GSM8K conversion: ground truths, the four variants, malformed lines, the real training file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.data.cli import cli_main, known_agent_names
from agentrl.data.dataset import RowDataset, validate_files
from agentrl.data.io import iter_raw_rows, write_rows
from agentrl.data.row import Row
from agentrl_data_prep.gsm8k import VARIANTS, MalformedRecord, convert, convert_record, ground_truth_of, sft_messages
from real_data import GSM8K_TRAIN, needs_gsm8k

REPO = Path(__file__).resolve().parents[2]
REAL = GSM8K_TRAIN
ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 1,272"
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48/2"}}}


def test_ground_truth_is_the_text_after_hashes_without_thousands_separators():
    assert ground_truth_of(ANSWER) == "1272"
    assert ground_truth_of("x\n#### 1,200") == "1200"
    assert ground_truth_of("x\n#### -3.5") == "-3.5"
    with pytest.raises(MalformedRecord, match="no '#### <final answer>' line"):
        ground_truth_of("the answer is 5")


def test_sft_turns_annotations_into_exact_tool_calls():
    messages = sft_messages("How many?", ANSWER)
    assert messages == [
        {"role": "user", "content": "How many?"},
        {"role": "assistant", "content": "Natalia sold 48/2 = ", "tool_calls": [CALL]},
        {"role": "tool", "content": "24"},
        {"role": "assistant", "content": "24 clips in May.\nNatalia sold 48+24 = ", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48+24"}}}]},
        {"role": "tool", "content": "72"},
        {"role": "assistant", "content": "72 clips altogether.\n#### 1272"},
    ]


def test_a_solution_without_annotations_is_one_assistant_message():
    assert sft_messages("q", "Half of 10 is 5.\n#### 5")[1:] == [{"role": "assistant", "content": "Half of 10 is 5.\n#### 5"}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_builds_a_valid_row(variant):
    row = convert_record({"question": "How many?", "answer": ANSWER}, 5, variant, "train")
    assert row["data_source"] == "openai/gsm8k"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1272"}
    assert row["extra_info"].items() >= {"index": 5, "split": "train", "question": "How many?", "answer": ANSWER}.items()
    Row.model_validate(row)
    expected_agent = {"single_turn": "single_turn", "tool": "tool_agent", "interaction": "tool_agent", "sft": None}[variant]
    assert row.get("agent_name") == expected_agent
    if variant == "tool":
        assert row["extra_info"]["tools_kwargs"] == {
            "calculator": {"create_kwargs": {}}, "check_answer": {"create_kwargs": {"ground_truth": "1272"}},
        }
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    if variant == "interaction":
        assert row["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", "query": "How many?", "ground_truth": "1272"}
    if variant == "single_turn":
        assert row["prompt"] == [{"role": "user", "content": 'How many? Let\'s think step by step and output the final answer after "####".'}]
    if variant == "sft":
        assert row["prompt"] == [{"role": "user", "content": "How many?"}] and len(row["messages"]) == 6


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path):
    source = tmp_path / "g.jsonl"
    good = json.dumps({"question": "q", "answer": "a\n#### 1"}).encode()
    lines = [good, b"{not json", json.dumps({"question": "q"}).encode(), json.dumps({"question": "q", "answer": "no final"}).encode(),
             b"\xff\xfe", b"[1, 2]", good]
    source.write_bytes(b"\n".join(lines) + b"\n")
    rows, problems = convert(source, "tool")
    assert [r["extra_info"]["index"] for r in rows] == [0, 6]
    assert problems == [
        (2, "invalid JSON (Expecting property name enclosed in double quotes)"),
        (3, "missing 'answer'"),
        (4, "the answer has no '#### <final answer>' line"),
        (5, "not UTF-8 text"),
        (6, "not a JSON object"),
    ]
    out = tmp_path / "o.parquet"
    assert cli_main(["gsm8k", "--input", str(source), "--output", str(out), "--variant", "tool"]) == 0
    assert [raw["extra_info"]["index"] for _, raw in iter_raw_rows(out)] == [0, 6]


def test_strict_fails_on_the_first_malformed_line_and_writes_nothing(tmp_path):
    source = tmp_path / "g.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "a\n#### 1"}) + "\n{not json\n")
    with pytest.raises(MalformedRecord, match=r"g.jsonl: line 2: invalid JSON"):
        convert(source, "tool", strict=True)
    out = tmp_path / "o.parquet"
    assert cli_main(["gsm8k", "--input", str(source), "--output", str(out), "--variant", "tool", "--strict"]) == 1
    assert not out.exists()


def test_limit_and_split_follow_the_command_line(tmp_path):
    source = tmp_path / "test.jsonl"
    source.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a\n#### {i}"}) + "\n" for i in range(5)))
    rows, _ = convert(source, "single_turn", limit=2)
    assert [(r["extra_info"]["index"], r["extra_info"]["split"]) for r in rows] == [(0, "test"), (1, "test")]
    rows, _ = convert(source, "single_turn", split="dev")
    assert {r["extra_info"]["split"] for r in rows} == {"dev"}


def test_parquet_source_is_accepted(tmp_path):
    src = write_rows([{"question": "q", "answer": "a <<2*3=6>>6\n#### 6"}], tmp_path / "src.parquet")
    rows, problems = convert(src, "sft")
    assert problems == [] and rows[0]["messages"][2] == {"role": "tool", "content": "6"}


def test_a_parquet_source_without_the_columns_is_named(tmp_path, capsys):
    src = write_rows([{"q": "x"}], tmp_path / "src.parquet")
    assert cli_main(["gsm8k", "--input", str(src), "--output", str(tmp_path / "o.parquet"), "--variant", "tool"]) == 1
    assert f"file {src}: missing column(s) question, answer" in capsys.readouterr().err


# ---------------------------------------------------------------- the real 7,473-row training file

def needs_real(test):
    for mark in needs_gsm8k:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def source_records():
    return [json.loads(line) for line in REAL.read_text().splitlines()]


def annotations(answer: str) -> list[tuple[str, str]]:
    """(expression, value) of each <<expression=value>>, found without the converter's regex."""
    found = []
    for piece in answer.split("<<")[1:]:
        inside = piece.split(">>")[0]
        expression, _, value = inside.partition("=")
        found.append((expression.strip(), value.strip()))
    return found


@needs_real
@pytest.mark.parametrize("variant", VARIANTS)
def test_real_training_file_converts_completely(variant, source_records, tmp_path):
    out = tmp_path / f"{variant}.parquet"
    assert cli_main(["gsm8k", "--input", str(REAL), "--output", str(out), "--variant", variant]) == 0
    rows = [raw for _, raw in iter_raw_rows(out)]
    assert len(rows) == len(source_records) == 7473
    for i, (record, row) in enumerate(zip(source_records, rows)):
        assert row["extra_info"]["index"] == i and row["extra_info"]["split"] == "train"
        truth = record["answer"].split("#### ")[-1].strip().replace(",", "")
        assert row["reward_model"]["ground_truth"] == truth
        if variant == "tool":
            assert row["extra_info"]["tools_kwargs"]["check_answer"]["create_kwargs"] == {"ground_truth": truth}
        if variant == "sft":
            expected = annotations(record["answer"])
            calls = [c["function"] for m in row["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            assert calls == [{"name": "calculator", "arguments": {"expression": e}} for e, _ in expected]
            assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == [v for _, v in expected]
            text = "".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
            body = record["answer"].rpartition("####")[0]
            assert text == re.sub(r"<<[^>]*>>", "", body) + f"#### {truth}"
    assert validate_files([out], known_agent_names=known_agent_names()) == []
    assert len(RowDataset([out], batch_size=64).next_batch()) == 64


@needs_real
def test_the_documented_command_converts_the_real_file(tmp_path):
    out = tmp_path / "tool.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "data_prep.gsm8k", "--input", str(REAL), "--output", str(out), "--variant", "tool", "--limit", "100"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote 100 rows (tool) to {out}; skipped 0"
    assert [raw["extra_info"]["index"] for _, raw in iter_raw_rows(out)] == list(range(100))


def test_data_validate_cli(tmp_path):
    good = write_rows(convert_all(["q0", "q1", "q2", "q3"]), tmp_path / "good.parquet")
    bad_rows = convert_all(["q0", "q1"])
    bad_rows[1]["agent_name"] = "nope"
    bad = write_rows(bad_rows, tmp_path / "bad.parquet")
    ok = subprocess.run([sys.executable, "-m", "agentrl.cli", "data", "validate", str(good)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "4 rows in 1 file: all valid" in ok.stdout
    fail = subprocess.run([sys.executable, "-m", "agentrl.cli", "data", "validate", str(bad)], capture_output=True, text=True, timeout=120)
    assert fail.returncode == 1
    assert f"file {bad}, row 1, field agent_name: unknown agent_name 'nope' (known: " in fail.stdout


def convert_all(questions):
    return [convert_record({"question": q, "answer": "a\n#### 1"}, i, "tool", "train") for i, q in enumerate(questions)]

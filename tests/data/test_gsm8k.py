"""GSM8K conversion: ground truths, the four variants, malformed lines, the real training file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.data.dataset import RowDataset, validate_files
from agentrl.data.io import iter_raw_rows
from agentrl_data_prep.gsm8k import VARIANTS, convert, convert_record, ground_truth_of, sft_messages

REPO = Path(__file__).resolve().parents[2]
REAL = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 1,272"


def test_ground_truth_is_the_text_after_hashes_without_thousands_separators():
    assert ground_truth_of(ANSWER) == "1272"
    assert ground_truth_of("x\n#### -3.5") == "-3.5"


def test_sft_turns_annotations_into_exact_tool_calls():
    messages = sft_messages("How many?", ANSWER)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[1] == {
        "role": "assistant", "content": "Natalia sold 48/2 = ",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48/2"}}}],
    }
    assert messages[2] == {"role": "tool", "content": "24"}
    assert messages[3]["content"] == "24 clips in May.\nNatalia sold 48+24 = "
    assert messages[5]["content"] == "72 clips altogether.\n#### 1272"


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_builds_a_valid_row(variant, tmp_path):
    row = convert_record({"question": "How many?", "answer": ANSWER}, 5, variant, "train")
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1272"}
    assert row["extra_info"]["index"] == 5
    from agentrl.data.row import Row

    Row.model_validate(row)
    if variant == "tool":
        assert row["extra_info"]["tools_kwargs"]["check_answer"] == {"create_kwargs": {"ground_truth": "1272"}}
        assert row["agent_name"] == "tool_agent"
    if variant == "interaction":
        assert row["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", "query": "How many?", "ground_truth": "1272"}
    if variant == "single_turn":
        assert row["prompt"][0]["content"].endswith('output the final answer after "####".')


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path):
    source = tmp_path / "g.jsonl"
    good = json.dumps({"question": "q", "answer": "a\n#### 1"})
    source.write_text("\n".join([good, "{not json", json.dumps({"question": "q"}), json.dumps({"question": "q", "answer": "no final"}), good]) + "\n")
    rows, problems = convert(source, "tool")
    assert len(rows) == 2 and [r["extra_info"]["index"] for r in rows] == [0, 4]
    assert problems == [
        (2, "invalid JSON (Expecting property name enclosed in double quotes)"),
        (3, "missing 'answer'"),
        (4, "the answer has no '#### <final answer>' line"),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "data_prep.gsm8k", "--input", str(source), "--output", str(tmp_path / "o.parquet"), "--variant", "tool", "--strict"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert out.returncode == 1
    assert f"{source}: line 2: invalid JSON" in out.stderr


def test_parquet_source_is_accepted(tmp_path):
    from agentrl.data.io import write_rows

    src = write_rows([{"question": "q", "answer": "a <<2*3=6>>6\n#### 6"}], tmp_path / "src.parquet")
    rows, problems = convert(src, "sft")
    assert problems == [] and rows[0]["messages"][2] == {"role": "tool", "content": "6"}


needs_real = pytest.mark.skipif(not REAL.is_file(), reason=f"the GSM8K training file is not at {REAL}")


@needs_real
@pytest.mark.parametrize("variant", VARIANTS)
def test_real_training_file_converts_completely(variant, tmp_path):
    out = tmp_path / f"{variant}.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "data_prep.gsm8k", "--input", str(REAL), "--output", str(out), "--variant", variant],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert "wrote 7473 rows" in done.stdout
    source = [json.loads(line) for line in REAL.read_text().splitlines()]
    rows = [raw for _, raw in iter_raw_rows(out)]
    assert len(rows) == 7473
    for i, (record, row) in enumerate(zip(source, rows)):
        assert row["extra_info"]["index"] == i
        assert row["reward_model"]["ground_truth"] == record["answer"].split("#### ")[-1].strip().replace(",", "")
        if variant == "sft":
            annotations = re.findall(r"<<([^<>=]*)=([^<>]*)>>", record["answer"])
            calls = [m for m in row["messages"] if m.get("tool_calls")]
            assert [c["tool_calls"][0]["function"]["arguments"]["expression"] for c in calls] == [a.strip() for a, _ in annotations]
            assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == [v.strip() for _, v in annotations]
    if variant != "sft":
        assert validate_files([out]) == []
        assert len(RowDataset([out], batch_size=64).next_batch()) == 64


def test_data_validate_cli(tmp_path):
    from agentrl.data.io import write_rows
    from agentrl_data_prep.tasks import generate

    good = write_rows(generate("arith", 4), tmp_path / "good.parquet")
    bad_rows = generate("arith", 2)
    bad_rows[1]["agent_name"] = "nope"
    bad = write_rows(bad_rows, tmp_path / "bad.parquet")
    ok = subprocess.run([sys.executable, "-m", "agentrl.cli", "data", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "4 rows in 1 file(s): all valid" in ok.stdout
    fail = subprocess.run([sys.executable, "-m", "agentrl.cli", "data", "validate", str(bad)], capture_output=True, text=True)
    assert fail.returncode == 1 and f"file {bad}, row 1, field agent_name: unknown agent_name 'nope'" in fail.stdout

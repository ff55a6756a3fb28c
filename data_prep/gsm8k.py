"""Convert GSM8K (jsonl or parquet with ``question``/``answer``) into agentrl rows.

    python -m data_prep.gsm8k --input train.jsonl --output gsm8k_tool.parquet --variant tool

Variants:

* ``single_turn``: the question plus an instruction to end with ``#### <answer>``;
* ``tool``: a calculator and an answer-checking tool (``check_answer`` gets the ground truth
  through ``extra_info.tools_kwargs``); agent ``tool_agent``;
* ``interaction``: ``extra_info.interaction_kwargs = {name: gsm8k, query, ground_truth}``:
  the model is told when it is wrong and may retry; agent ``tool_agent``;
* ``sft``: a ``messages`` column with multi-turn conversations built from the solution's
  calculator annotations (``prompt`` holds the user turn alone). The solution text up to an
  annotation ``<<48/2=24>>`` becomes an assistant message carrying a ``calculator`` call
  ``{"expression": "48/2"}`` (OpenAI ``tool_calls`` format, arguments as a dict); a tool message
  answers ``24``; the text continues after the annotation in the next assistant message, and
  the last one ends with ``#### <ground truth>``. Nothing else is changed: the assistant
  contents joined together are the solution with its annotations removed, the final line
  normalized to ``#### <ground truth>``.

``reward_model.ground_truth`` is the text after ``#### `` with thousands separators (commas)
removed. ``extra_info.index`` is the 0-based line number in a jsonl source (0-based row in a
parquet one), as verl's ``enumerate`` gives it, so ``row_uid`` is ``openai/gsm8k:<index>``.
``extra_info.split`` is ``--split``, by default the input's file stem when that is ``train`` or
``test``. Malformed lines (bad JSON, missing fields, no ``####``) are reported with their 1-based
line number (as an editor shows it; parquet rows by 0-based row index) and skipped, or end the
run with ``--strict``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from agentrl.errors import DataError

__all__ = ["VARIANTS", "MalformedRecord", "ground_truth_of", "convert_record", "sft_messages", "read_source", "convert", "main"]

VARIANTS = ("single_turn", "tool", "interaction", "sft")
DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_SYSTEM = (
    "You are a math expert. Use the calculator tool for arithmetic, check your final answer with "
    "check_answer, and end with #### <answer>."
)
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_FINAL = re.compile(r"####\s*(.+?)\s*$")


class MalformedRecord(DataError):
    """A source record cannot be converted (the message names the file and line)."""


def ground_truth_of(answer: str) -> str:
    match = _FINAL.search(answer.strip())
    if match is None:
        raise MalformedRecord("the answer has no '#### <final answer>' line")
    return match.group(1).replace(",", "")


def sft_messages(question: str, answer: str) -> list[dict[str, Any]]:
    """The solution as a tool-using conversation (see the module docstring)."""
    body, _, _ = answer.rpartition("####")
    gt = ground_truth_of(answer)
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    position = 0
    for match in _ANNOTATION.finditer(body):
        expression, value = match.group(1).strip(), match.group(2).strip()
        text = body[position : match.start()]
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages.append({"role": "assistant", "content": text, "tool_calls": [call]})
        messages.append({"role": "tool", "content": value})
        position = match.end()
    messages.append({"role": "assistant", "content": f"{body[position:]}#### {gt}"})
    return messages


def convert_record(record: dict[str, Any], index: int, variant: str, split: str) -> dict[str, Any]:
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise MalformedRecord("missing or empty 'question'")
    if not isinstance(answer, str):
        raise MalformedRecord("missing 'answer'")
    gt = ground_truth_of(answer)
    extra: dict[str, Any] = {"index": index, "split": split, "question": question, "answer": answer}
    row: dict[str, Any] = {
        "data_source": DATA_SOURCE,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": extra,
    }
    if variant == "single_turn":
        row["prompt"] = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
        row["agent_name"] = "single_turn"
    elif variant == "tool":
        row["prompt"] = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": question}]
        extra["tools_kwargs"] = {"calculator": {"create_kwargs": {}}, "check_answer": {"create_kwargs": {"ground_truth": gt}}}
        row["agent_name"] = "tool_agent"
    elif variant == "interaction":
        row["prompt"] = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
        extra["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": gt}
        row["agent_name"] = "tool_agent"
    elif variant == "sft":
        messages = sft_messages(question, answer)
        row["prompt"] = messages[:1]
        row["messages"] = messages
    else:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return row


def is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


def read_source(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(0-based index, record or None, problem) for each line of a jsonl file or row of a parquet file."""
    if is_parquet(path):
        from agentrl.data.io import iter_raw_rows

        for index, raw in iter_raw_rows(path, columns=["question", "answer"]):
            yield index, raw, None
        return
    with path.open("rb") as f:  # decoded line by line, so one bad line does not end the file
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield index, None, "not UTF-8 text"
                continue
            if not line.strip():
                yield index, None, "empty line"
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield index, None, f"invalid JSON ({exc.msg})"
                continue
            if not isinstance(record, dict):
                yield index, None, "not a JSON object"
                continue
            yield index, record, None


def default_split(path: Path) -> str:
    return path.stem if path.stem in ("train", "test") else "train"


def convert(path: Path, variant: str, *, split: str | None = None, strict: bool = False, limit: int | None = None):
    """Rows and (line number, reason) problems; raises on the first problem when ``strict``.
    Line numbers are 1-based for jsonl, 0-based row indices for parquet."""
    split = split or default_split(path)
    rows: list[dict[str, Any]] = []
    problems: list[tuple[int, str]] = []
    unit, base = ("row", 0) if is_parquet(path) else ("line", 1)
    for index, record, problem in read_source(path):
        if limit is not None and len(rows) >= limit:
            break
        if problem is None:
            try:
                rows.append(convert_record(record, index, variant, split))  # type: ignore[arg-type]
                continue
            except MalformedRecord as exc:
                problem = str(exc)
        problems.append((index + base, problem))
        if strict:
            raise MalformedRecord(f"{path}: {unit} {index + base}: {problem}")
    return rows, problems


def main(argv: list[str] | None = None, *, prog: str = "python -m data_prep.gsm8k") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Convert GSM8K into agentrl rows.")
    parser.add_argument("--input", required=True, type=Path, help="GSM8K jsonl or parquet (question, answer)")
    parser.add_argument("--output", required=True, type=Path, help="output parquet file")
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--split", default=None, help="extra_info.split (default: the input's stem if train/test, else train)")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed line instead of skipping it")
    parser.add_argument("--limit", type=int, default=None, help="convert at most this many rows")
    args = parser.parse_args(argv)
    if not args.input.is_file():
        print(f"error: input file not found: {args.input}", file=sys.stderr)
        return 2
    try:
        rows, problems = convert(args.input, args.variant, split=args.split, strict=args.strict, limit=args.limit)
    except DataError as exc:  # MalformedRecord included
        print(f"error: {exc}", file=sys.stderr)
        return 1
    unit = "row" if is_parquet(args.input) else "line"
    for number, reason in problems:
        print(f"{args.input}: {unit} {number}: skipped: {reason}", file=sys.stderr)
    from agentrl.data.io import write_rows

    write_rows(rows, args.output)
    print(f"wrote {len(rows)} rows ({args.variant}) to {args.output}; skipped {len(problems)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

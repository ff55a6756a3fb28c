"""Datasets and model outputs from elsewhere are data: hostile fields get a DataError naming the
file, row and field, or are carried through untouched; text that looks like template code is
rendered as text, never evaluated."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.agent.render import ChatRenderer
from agentrl.agent.tool_parsers import HermesToolParser, ReactToolParser
from agentrl.data.dataset import parse_row, validate_files
from agentrl.data.io import iter_raw_rows

INJECTION = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for x in range(3) %}X{% endfor %}{{ 7*7 }}"
DEEP = "[" * 100_000 + "]" * 100_000


def parquet(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # written as a third party would, not through write_rows
    return str(path)


def user(content) -> dict:
    return {"data_source": "elsewhere", "prompt": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({**user("hi"), "extra_info": {"tools_kwargs": "{not json"}}, "extra_info.tools_kwargs", "not valid JSON"),
        ({**user("hi"), "extra_info": {"tools_kwargs": DEEP}}, "extra_info.tools_kwargs", "not valid JSON"),
        ({**user("hi"), "extra_info": {"interaction_kwargs": "[1,"}}, "extra_info.interaction_kwargs", "not valid JSON"),
        ({"data_source": "x", "prompt": [{"role": "assistant", "content": "", "tool_calls": DEEP}]}, "prompt.0.tool_calls", "not valid JSON"),
        ({"data_source": "x", "prompt": [{"role": "root", "content": "x"}]}, "prompt.0.role", "Input should be 'system', 'user', 'assistant' or 'tool' (got 'root')"),
        (user(5), "prompt.0.content", "Input should be a valid string"),
        ({"data_source": "x", "prompt": "hello"}, "prompt", "Input should be a valid list"),
        ({"data_source": "x", "prompt": []}, "prompt", "List should have at least 1 item"),
        ({"data_source": 3, "prompt": [{"role": "user", "content": "x"}]}, "data_source", "Input should be a valid string (got 3)"),
    ],
)
def test_a_hostile_field_is_a_data_error_naming_file_row_and_field(tmp_path, row, field, message):
    path = parquet(tmp_path, [row])
    [problem] = validate_files([path])
    assert problem.file == path and problem.row == 0 and problem.field == field
    assert message in str(problem)


def test_a_huge_prompt_is_carried_as_plain_data(tmp_path):
    content = "x" * (8 * 2**20) + INJECTION
    path = parquet(tmp_path, [user(content)])
    assert validate_files([path]) == []
    [(index, raw)] = list(iter_raw_rows(path))
    assert parse_row(raw, file=path, index=index).prompt[0].content == content


def test_template_code_in_a_prompt_is_rendered_as_text_not_evaluated(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer)
    messages = [{"role": "system", "content": INJECTION}, {"role": "user", "content": INJECTION}]
    text = tiny_tokenizer.decode(renderer.prompt_ids(messages))
    assert text.count(INJECTION) == 2  # verbatim, twice
    assert "<class" not in text and "XXX" not in text and "49" not in text
    reference = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert renderer.prompt_ids(messages) == tiny_tokenizer.encode(reference, add_special_tokens=False)
    # an observation (a tool result: model-influenced text) is data as well
    observed = tiny_tokenizer.decode(renderer.observation_ids([{"role": "tool", "content": INJECTION}]))
    assert INJECTION in observed and "<class" not in observed


def test_deeply_nested_tool_calls_in_model_output_are_a_bad_call_not_a_crash():
    [call] = HermesToolParser().parse(f"<tool_call>{DEEP}</tool_call>").calls
    assert (call.error, call.detail) == ("bad_json", "the tool call is nested too deeply to parse")
    [call] = HermesToolParser().parse('<tool_call>{"name": "calc", "arguments": "' + DEEP + '"}</tool_call>').calls
    assert (call.name, call.error) == ("calc", "bad_json")
    [call] = ReactToolParser().parse("Action: calc\nAction Input: {" + "[" * 50_000).calls
    assert call.error == "bad_json" or call.arguments is not None

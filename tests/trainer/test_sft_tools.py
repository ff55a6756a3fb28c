"""The SFT tools block: the tools RL offers rows that name none when some are configured, else
the tools the demonstrations call themselves; never a silent stand-in (it was ``calculator``)."""

from __future__ import annotations

import json

import pytest

from agentrl.config.schema import TrainConfig
from agentrl.errors import DataError
from agentrl.plugins import PluginRegistry
from agentrl.trainer.sft import tool_schemas


# demonstrations from files (no generating task): their own tools only
FILES = {"data": {"task": None}}


def schema(name: str) -> dict:
    return PluginRegistry().load("tools", name).schema()


def calling(tool: str, question: str = "Is 408 right?") -> list[dict]:
    call = {"type": "function", "function": {"name": tool, "arguments": {"answer": "408"}}}
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "correct"}, {"role": "assistant", "content": "#### 408"}]


PLAIN = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "#### 4"}]


def test_demonstrations_calling_another_tool_get_that_tools_block_not_the_calculators():
    cfg = TrainConfig.model_validate(FILES)
    assert tool_schemas(cfg, [PLAIN, calling("check_answer"), calling("gsm8k_answer"), calling("check_answer")]) == [
        schema("check_answer"), schema("gsm8k_answer")]


def test_demonstrations_that_call_no_tool_get_no_tools_block():
    assert tool_schemas(TrainConfig.model_validate(FILES), [PLAIN, PLAIN]) is None


def test_configured_tools_are_the_block_as_rl_offers_them():
    cfg = TrainConfig.model_validate({"agent": {"tool_config": {"calculator": {}, "check_answer": {}}}})
    assert tool_schemas(cfg, [PLAIN, calling("check_answer")]) == [schema("calculator"), schema("check_answer")]


def test_a_demonstration_calling_a_tool_the_config_leaves_out_names_its_file_row_and_the_config(tmp_path):
    from agentrl import write_rows

    first = write_rows([{"messages": PLAIN}] * 3, tmp_path / "a.parquet")
    second = write_rows([{"messages": PLAIN}, {"messages": calling("check_answer")}], tmp_path / "b.parquet")
    cfg = TrainConfig.model_validate({"sft": {"train_files": [str(first), str(second)]},
                                      "agent": {"tool_config": {"calculator": {}}}})
    with pytest.raises(DataError) as info:
        tool_schemas(cfg, [PLAIN] * 4 + [calling("check_answer")])
    assert str(info.value) == (
        f"file {second}, row 1, field messages: the demonstration calls tool 'check_answer', which the configured tools "
        "(calculator) leave out of the tools block: add it to agent.tool_config (or agent.tool_config_path)")


def test_a_demonstration_calling_a_tool_nothing_defines_is_an_error_naming_it():
    with pytest.raises(DataError) as info:
        tool_schemas(TrainConfig.model_validate(FILES), [PLAIN, PLAIN, calling("weather")])
    assert str(info.value) == (
        "row 2, field messages: the demonstration calls tool 'weather', which no installed tool plugin provides and "
        "agent.tool_config_path does not define: its schema is needed for the tools block")


def test_a_tool_of_the_verl_tool_yaml_gives_its_own_schema(tmp_path):
    weather = {"type": "function", "function": {"name": "weather", "description": "the weather",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "calculator", "config": {}, "tool_schema": weather}]}))
    cfg = TrainConfig.model_validate({**FILES, "agent": {"tool_config_path": str(path)}})
    assert tool_schemas(cfg, [calling("weather")]) == [weather]


def test_generated_demonstrations_get_their_tasks_tools_even_when_none_calls_one():
    from agentrl_data_prep.tasks import sft_conversations

    cfg = TrainConfig.model_validate({"sft": {"tool_rate": 0.0}})
    conversations = sft_conversations(cfg.data.task, 4, seed=1, tool_rate=0.0)
    assert not any(m.get("tool_calls") for c in conversations for m in c)
    assert tool_schemas(cfg, conversations) == [schema("calculator")]  # as RL offers the task's rows

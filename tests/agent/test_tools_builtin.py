"""The built-in tools (calculator, check_answer) and ``agentrl tools call/list``."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.agent.tools_runtime import validate_arguments
from agentrl.errors import ToolError
from agentrl.plugins import PluginRegistry
from agentrl_tools.calculator import CalculatorTool, evaluate, format_number
from agentrl_tools.check_answer import CheckAnswerTool
from real_data import GSM8K_TRAIN



def calc(expression: str) -> str:
    return asyncio.run(CalculatorTool().execute("i", {"expression": expression})).text


@pytest.mark.parametrize(
    "expression, text",
    [
        ("3*4", "12"),
        ("48/2", "24"),  # an integral float is shown without ".0"
        ("1/3", "0.333333"),
        ("2/3", "0.666667"),
        ("0.1+0.2", "0.3"),
        ("-(3-5)", "2"),
        ("(1 + 2) * 3", "9"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2**10", "1024"),
        ("2^10", "1024"),  # models write ^ for powers
        ("2**-2", "0.25"),
        ("3 × 4", "12"),
        ("1e-9", "1e-09"),  # too small for 6 decimals: 6 significant digits instead
        ("12.50+12.50+5.00", "30"),
        ("10**18", "1000000000000000000"),
        ("-" * 499 + "1", "-1"),  # deep but within the length bound
    ],
)
def test_calculator_evaluates_arithmetic_to_text(expression, text):
    assert calc(expression) == text


@pytest.mark.parametrize(
    "expression, message",
    [
        ("x + 1", "unknown name 'x': only numbers, + - * / // % ** and parentheses are allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("(1).real", "unsupported Attribute"),
        ("[1, 2]", "unsupported List"),
        ("lambda: 1", "unsupported Lambda"),
        ("'a' * 3", "only numbers are allowed, not 'a'"),
        ("True + 1", "only numbers are allowed, not True"),
        ("1,000 * 3", "commas are not allowed (write 1000, not 1,000)"),
        ("2**65", "exponent 65 is too large (at most 64)"),
        ("2**-100", "exponent -100 is too large (at most 64)"),
        ("9**9**9", "exponent 387420489 is too large (at most 64)"),
        ("(10**18)**64", "result out of range"),
        ("1e18**64", "result out of range"),  # a float overflow, not a crash
        ("10**18 * 10", "result out of range"),
        ("1e400", "result out of range"),
        ("(-8) ** 0.5", "the result is not a real number"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("", "empty expression"),
        ("3 *", "cannot parse '3 *': invalid syntax"),
        ("1+" * 300 + "1", "expression too long (601 characters, at most 500)"),
        ("(" * 201 + "1" + ")" * 201, "cannot parse '" + "(" * 57 + "...': too many nested parentheses"),
    ],
)
def test_calculator_refuses_with_a_message_for_the_model(expression, message):
    with pytest.raises(ToolError) as info:
        calc(expression)
    assert message in str(info.value)


def test_format_number_drops_zero_fractions_and_rounds_to_six_decimals():
    assert [format_number(v) for v in (24, 24.0, -0.0, 2.5, 1 / 7, 0.9999999, -1 / 3, 5e-7)] == [
        "24", "24", "0", "2.5", "0.142857", "1", "-0.333333", "5e-07",
    ]


@pytest.mark.gsm8k
@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason=f"the GSM8K training file is not at {GSM8K_TRAIN} (set AGENTRL_GSM8K)")
def test_calculator_reproduces_every_gsm8k_training_annotation():
    # <<48/2=24>>: the sft data variant turns each annotation into a calculator call
    annotation = re.compile(r"<<([^=<>]*)=([^<>]*)>>")
    pairs = [pair for line in GSM8K_TRAIN.open() for pair in annotation.findall(json.loads(line)["answer"])]
    wrong = [(e, r) for e, r in pairs if abs(evaluate(e) - float(r)) > 1e-9]
    assert len(pairs) == 23716 and wrong == []
    # textually equal too, except the annotations' own trailing zeros ("144.00", ".5")
    assert sum(format_number(evaluate(e)) == r for e, r in pairs) == 23049


def test_tool_schemas_are_the_class_attributes_in_openai_function_format():
    assert CalculatorTool.schema() == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "the expression to evaluate, for example 4821 * 37"}
                },
                "required": ["expression"],
            },
        },
    }
    assert CheckAnswerTool.schema()["function"]["parameters"]["required"] == ["answer"]
    assert validate_arguments(CalculatorTool, {"expression": "1"}) is None
    assert validate_arguments(CalculatorTool, {"expression": 1}) == "invalid arguments for calculator: expression: 1 is not of type 'string'"


def test_builtin_tools_resolve_through_their_entry_points():
    registry = PluginRegistry()
    assert registry.load("tools", "calculator") is CalculatorTool
    assert registry.load("tools", "check_answer") is CheckAnswerTool


def test_check_answer_lifecycle_rewards_each_check_and_reports_the_last():
    async def scenario():
        tool = CheckAnswerTool()
        await tool.create("a", ground_truth="72")
        await tool.create("b", ground_truth="1000")
        assert await tool.calc_reward("a") == 0.0  # nothing checked yet
        first = await tool.execute("a", {"answer": "70"})
        assert (first.text, first.reward) == ("incorrect", 0.0)
        second = await tool.execute("a", {"answer": "#### 72"})
        assert (second.text, second.reward) == ("correct", 1.0)
        assert await tool.calc_reward("a") == 1.0
        await tool.execute("a", {"answer": "71"})
        assert await tool.calc_reward("a") == 0.0  # the last check counts
        assert (await tool.execute("b", {"answer": "$1,000"})).text == "correct"  # instances are separate
        await tool.release("a")
        assert await tool.calc_reward("a") is None
        with pytest.raises(ToolError, match="check_answer has no instance 'a' \\(create was not called\\)"):
            await tool.execute("a", {"answer": "72"})
        assert await tool.calc_reward("b") == 1.0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "answer, text",
    [("72", "correct"), ("72.0", "correct"), ("It is 72 clips.", "correct"), ("-72", "incorrect"), ("seventy-two", "incorrect"), ("7.2", "incorrect")],
)
def test_check_answer_compares_the_last_number_numerically(answer, text):
    async def scenario():
        tool = CheckAnswerTool()
        await tool.create("i", ground_truth="72")
        return (await tool.execute("i", {"answer": answer})).text

    assert asyncio.run(scenario()) == text


def test_check_answer_without_ground_truth_says_where_it_should_come_from():
    async def scenario():
        tool = CheckAnswerTool()
        await tool.create("i")  # a row that enables every tool but gives this one nothing
        assert await tool.calc_reward("i") is None
        await tool.execute("i", {"answer": "72"})

    with pytest.raises(ToolError, match=r"needs extra_info\.tools_kwargs\.check_answer\.create_kwargs\.ground_truth"):
        asyncio.run(scenario())


def agentrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=60)


def test_tools_call_prints_the_calculator_result_as_json():
    out = agentrl("tools", "call", "calculator", "--arguments", '{"expression": "3*4"}')
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"text": "12", "reward": None, "metrics": {}, "calc_reward": None}


def test_tools_call_runs_create_and_calc_reward_with_create_kwargs():
    out = agentrl("tools", "call", "check_answer", "--arguments", '{"answer": "72"}', "--create-kwargs", '{"ground_truth": "72"}')
    assert json.loads(out.stdout) == {"text": "correct", "reward": 1.0, "metrics": {}, "calc_reward": 1.0}


@pytest.mark.parametrize(
    "args, error",
    [
        (["calculator", "--arguments", "{expression: 1}"], "--arguments is not valid JSON: Expecting property name enclosed in double quotes at position 1"),
        (["calculator", "--arguments", "[1]"], "--arguments must be a JSON object, got list"),
        (["calculator", "--arguments", "{}", "--create-kwargs", "nope"], "--create-kwargs is not valid JSON"),
        (["calculator", "--arguments", '{"expression": "1"}', "--config", "nope"], "--config is not valid JSON"),
        (["calculator", "--arguments", '{"expr": "1"}'], "invalid arguments for calculator: arguments: 'expression' is a required property"),
        (["calculator", "--arguments", '{"expression": "1/0"}'], "division by zero"),
        (["weather", "--arguments", "{}"], "no plugin named 'weather' in group agentrl.tools"),
    ],
)
def test_tools_call_errors_are_json_with_exit_code_one(args, error):
    out = agentrl("tools", "call", *args)
    assert out.returncode == 1
    assert error in json.loads(out.stdout)["error"]


def test_tools_list_prints_every_builtin_schema():
    out = agentrl("tools", "list")
    schemas = {s["function"]["name"]: s for s in json.loads(out.stdout)}
    assert schemas["calculator"] == CalculatorTool.schema()
    assert schemas["check_answer"] == CheckAnswerTool.schema()


def test_a_checked_calculator_rewards_each_expected_step_once_and_other_calls_zero():
    from agentrl_tools.calculator import CalculatorTool

    tool = CalculatorTool()

    async def run() -> list:
        await tool.create("t", expected_steps=[408, 391], step_reward=0.5)
        await tool.create("plain")
        out = [await tool.execute("t", {"expression": e}) for e in ("12 * 34", "12 * 34", "400 + 1", "408 - 17")]
        out.append(await tool.execute("plain", {"expression": "12 * 34"}))
        await tool.release("t")
        out.append(await tool.execute("t", {"expression": "408 - 17"}))  # released: a plain call again
        return out

    results = asyncio.run(run())
    assert [r.text for r in results] == ["408", "408", "401", "391", "408", "391"]
    # the first 408 is a step, its repeat is not; a wrong value is 0; the second step; no steps: no reward
    assert [r.reward for r in results] == [0.5, 0.0, 0.0, 0.5, None, None]


def test_word_steps_rows_are_the_word_problems_with_their_steps_checked():
    from agentrl_data_prep.tasks import STEP_REWARD, generate, problems

    word, steps = generate("word", 20, seed=4), generate("word_steps", 20, seed=4)
    assert [r["prompt"] for r in word] == [r["prompt"] for r in steps]
    assert {r["data_source"] for r in steps} == {"agentrl/word"}
    for row, problem in zip(steps, problems("word", 20, 4, "train")):
        kwargs = row["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"]
        assert kwargs == {"expected_steps": [v for _, v in problem.steps], "step_reward": STEP_REWARD}
    assert all(r["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"] == {} for r in word)


def test_calculator_latency_is_lognormal_with_the_configured_median_and_p99_and_repeatable():
    from agentrl_tools.calculator import CalculatorTool

    tool = CalculatorTool(latency_median_s=0.3, latency_p99_s=6.2, latency_seed=1)
    waits = sorted(tool.latency_s(f"g{i}", 1) for i in range(20_000))
    assert waits[10_000] == pytest.approx(0.3, rel=0.05)
    assert waits[19_800] == pytest.approx(6.2, rel=0.15)
    assert tool.latency_s("g7", 2) == CalculatorTool(latency_median_s=0.3, latency_p99_s=6.2, latency_seed=1).latency_s("g7", 2)
    assert tool.latency_s("g7", 2) != tool.latency_s("g7", 3)
    assert CalculatorTool().latency_s("g7", 1) == 0.0
    with pytest.raises(ValueError, match=r"latency_p99_s \(0.1\) at least the median"):
        CalculatorTool(latency_median_s=0.3, latency_p99_s=0.1)

"""The main job of roles, ``data=solver_verifier`` (data_prep/solver_verifier.py,
agent_loops/solver_verifier.py): rows whose verifiers check right and wrong answers in equal
shares, the verifier's own working, the answer it checks and its reward by hand, and the warm
start's demonstrations of both roles."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl_agent_loops.solver_verifier import checked_answer, told_answer, verdict_of
from tests.agent.agent_helpers import make_row
from tests.agent.test_roles import script_by_role


def _one_digit_off(a: int, b: int) -> bool:
    return len(str(a)) == len(str(b)) and sum(x != y for x, y in zip(str(a), str(b))) == 1


def test_rows_ask_for_right_and_wrong_answers_in_turn_and_held_out_in_equal_shares(tmp_path):
    from agentrl.data.dataset import parse_row
    from agentrl.data.io import iter_raw_rows, write_rows
    from agentrl_data_prep.tasks import generate, validation_rows

    rows = generate("solver_verifier", 4, seed=0)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in generate("arith", 4, seed=0)]  # arith's problems
    assert {(r["agent_name"], r["data_source"]) for r in rows} == {("solver_verifier", "agentrl/solver_verifier")}
    assert [r["extra_info"]["verifier"]["checks_right"] for r in rows] == [True, False, True, False]
    for r in rows:  # the wrong answer to supply: one digit off the truth, as a "mental" answer is
        assert _one_digit_off(r["extra_info"]["verifier"]["wrong_answer"], int(r["reward_model"]["ground_truth"]))
    held_out = validation_rows("solver_verifier", 64)
    assert [r["extra_info"]["verifier"]["checks_right"] for r in held_out].count(True) == 32
    assert len(held_out) == 64
    # as the job reads them: through a parquet file, the kinds and answers intact
    path = write_rows(rows, tmp_path / "rows.parquet")
    read = [parse_row(raw, file=str(path), index=i) for i, raw in iter_raw_rows(path)]
    assert [r.extra_info.verifier for r in read] == [r["extra_info"]["verifier"] for r in rows]


def test_the_answer_checked_is_the_solvers_when_of_the_rows_kind_else_a_supplied_one():
    right_kind = make_row(agent="solver_verifier", verifier={"checks_right": True, "wrong_answer": 418})
    wrong_kind = make_row(agent="solver_verifier", verifier={"checks_right": False, "wrong_answer": 418})
    assert checked_answer(right_kind, "#### 408", True) == ("#### 408", True)
    assert checked_answer(right_kind, "#### 407", False) == ("#### 408", True)
    assert checked_answer(wrong_kind, "#### 407", False) == ("#### 407", False)
    assert checked_answer(wrong_kind, "#### 408", True) == ("#### 418", False)
    assert checked_answer(make_row(agent="solver_verifier"), "#### 407", False) == ("#### 407", False)  # no kind asked
    with pytest.raises(ValueError, match=r"^extra_info\.verifier must hold checks_right and wrong_answer, got \{'checks_right': True\}$"):
        checked_answer(make_row(verifier={"checks_right": True}), "#### 408", True)


@pytest.mark.parametrize("checks_right, solver, shown, verdicts, rewards", [
    (True, "#### 407", "#### 408", ["#### 0", "#### 1"], [1.0, 0.0]),   # the solver wrong: the truth supplied
    (False, "#### 408", "#### 418", ["#### 0", "#### -10"], [0.0, 1.0]),  # the solver right: the wrong answer supplied
    (False, "#### 407", "#### 407", ["#### 1", "no verdict"], [1.0, 0.0]),  # the solver's own wrong answer
])
def test_the_verifier_works_the_question_out_then_is_rewarded_for_its_verdict_on_the_answer_it_checked(
        tiny_tokenizer, make_ctx, checks_right, solver, shown, verdicts, rewards):
    row = make_row(agent="solver_verifier", verifier={"checks_right": checks_right, "wrong_answer": 418})
    answers = {"solver": [solver], "verifier/0": ["#### 408", verdicts[0]], "verifier/1": ["#### 400", verdicts[1]]}
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script_by_role(answers)))
    trajectories = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)], n=2))
    solver_reward = float(solver == "#### 408")
    assert [(t.role, t.reward) for t in trajectories] == [
        ("solver", solver_reward), ("verifier", rewards[0]), ("solver", solver_reward), ("verifier", rewards[1])]
    # the verifier starts from the row's messages, as the solver does; its own working is not what
    # it is rewarded for, only its verdict on the answer told after it
    for t, own, verdict in zip(trajectories[1::2], ["#### 408", "#### 400"], verdicts):
        assert t.messages == row.messages() + [{"role": "assistant", "content": own},
                                               {"role": "user", "content": f"Answer: {shown.removeprefix('#### ')}"},
                                               {"role": "assistant", "content": verdict}]
    assert trajectories[0].messages == row.messages() + [{"role": "assistant", "content": solver}]


def test_the_verifier_is_told_the_answers_number_alone_after_its_own_ending_in_hashes():
    # the two numbers its check copies follow different words ("#### <own>", "Answer: <told>")
    assert told_answer("#### 408") == {"role": "user", "content": "Answer: 408"}
    assert told_answer("so it is #### -10 \n") == {"role": "user", "content": "Answer: -10"}
    assert told_answer("I cannot tell") == {"role": "user", "content": "Answer: I cannot tell"}  # no number: as said


def test_a_frozen_verifier_judges_the_answer_of_the_rows_kind(tiny_tokenizer, make_ctx):
    """The loop tells only a sampled verifier (a frozen one has no context); the scripted judge is right."""
    row = make_row(agent="solver_verifier", verifier={"checks_right": False, "wrong_answer": 418})
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script_by_role({"solver": ["#### 408"]})), agent={"roles": {"verifier": "frozen"}})
    [solver] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)], n=1))
    assert solver.reward_info["role_rewards"] == {"solver": 1.0, "verifier": 1.0}
    assert verdict_of("#### 1") is False  # what the scripted judge says of the wrong answer it checked


def _check(messages: list[dict], own: int, shown: int) -> None:
    """The verifier's check: the calculator on ``<own> - <shown>``, its result, the verdict that result."""
    [call] = messages[0]["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": {"expression": f"{own} - {shown}"}}
    assert messages[1:] == [{"role": "tool", "content": str(own - shown)}, {"role": "assistant", "content": f"#### {own - shown}"}]


def test_the_demonstrations_every_other_a_verifier_who_works_the_question_out_then_checks_with_the_calculator():
    from agentrl_data_prep.solver_verifier import CHECK_FACTOR
    from agentrl_data_prep.tasks import SYSTEM_PROMPT, sft_conversations
    from agentrl_tools.calculator import evaluate

    demos = sft_conversations("solver_verifier", 80, seed=0, tool_rate=1.0 / CHECK_FACTOR)  # the verifier always computes
    solvers, verifiers = demos[0::2], demos[1::2]
    assert [d[-1]["role"] for d in solvers] == ["assistant"] * 40 and all("Answer:" not in str(d) for d in solvers)
    for d in verifiers:  # the solver's question and working, the answer told, then the check and its verdict
        assert [m["role"] for m in d] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"]
        assert d[0] == {"role": "system", "content": SYSTEM_PROMPT}
        expression = d[1]["content"].removeprefix("What is ").removesuffix("?")
        [call] = d[2]["tool_calls"]
        assert call["function"] == {"name": "calculator", "arguments": {"expression": expression}}
        assert d[3]["content"] == str(evaluate(expression)) and d[4]["content"] == f"#### {d[3]['content']}"
        shown = int(d[5]["content"].removeprefix("Answer: "))
        assert shown == evaluate(expression) or _one_digit_off(shown, evaluate(expression))
        _check(d[6:], evaluate(expression), shown)
    assert [d[-1]["content"] for d in verifiers].count("#### 0") not in (0, len(verifiers))  # right and wrong
    mental = sft_conversations("solver_verifier", 80, seed=0, tool_rate=0.0)[1::2]  # never computes: a "mental" answer
    assert {tuple(m["role"] for m in d) for d in mental} == {("system", "user", "assistant", "user", "assistant", "tool", "assistant")}
    for d in mental:  # its check compares the told answer with its own, one digit off the truth
        own, shown = int(d[2]["content"].removeprefix("#### ")), int(d[3]["content"].removeprefix("Answer: "))
        assert _one_digit_off(own, evaluate(d[1]["content"].removeprefix("What is ").removesuffix("?")))
        _check(d[4:], own, shown)


@pytest.mark.parametrize("checks_right, shown, check, result, reward", [
    (False, "418", "408 - 418", "-10", 1.0),  # a wrong answer told, checked: -10 says wrong
    (True, "408", "408 - 408", "0", 1.0),     # the right answer told: 0 says right
    (False, "418", "408 - 408", "0", 0.0),    # a check that copied its own answer twice: 0, a wrong verdict
])
def test_the_verifier_checks_with_the_calculator_and_its_result_is_the_verdict(
        tiny_tokenizer, make_ctx, checks_right, shown, check, result, reward):
    from tests.agent.agent_helpers import CALL_12x34

    call = CALL_12x34.replace("12 * 34", check)
    row = make_row(agent="solver_verifier", verifier={"checks_right": checks_right, "wrong_answer": 418})
    answers = {"solver": ["#### 408"], "verifier": [CALL_12x34, "#### 408", call, f"#### {result}"]}
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script_by_role(answers)))
    solver, verifier = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)], n=1))
    assert (verifier.role, verifier.reward) == ("verifier", reward)
    check_call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": check}}}
    assert verifier.messages[-5:] == [{"role": "assistant", "content": "#### 408"},
                                      {"role": "user", "content": f"Answer: {shown}"},
                                      {"role": "assistant", "content": "", "tool_calls": [check_call]},
                                      {"role": "tool", "content": result},
                                      {"role": "assistant", "content": f"#### {result}"}]
    assert verifier.metrics["tool_calls"] == 2  # its working and its check

"""The main job of roles, ``data=solver_verifier`` (data_prep/solver_verifier.py,
agent_loops/solver_verifier.py): rows whose verifiers check right and wrong answers in equal
shares, the answer each verifier checks and its reward by hand, and the warm start's
demonstrations of both roles."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl_agent_loops.solver_verifier import VERIFIER_PROMPT, checked_answer, verdict_of
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
def test_the_verifier_is_rewarded_for_its_verdict_on_the_answer_it_checked(
        tiny_tokenizer, make_ctx, checks_right, solver, shown, verdicts, rewards):
    row = make_row(agent="solver_verifier", verifier={"checks_right": checks_right, "wrong_answer": 418})
    answers = {"solver": [solver], "verifier/0": [verdicts[0]], "verifier/1": [verdicts[1]]}
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script_by_role(answers)))
    trajectories = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)], n=2))
    solver_reward = float(solver == "#### 408")
    assert [(t.role, t.reward) for t in trajectories] == [
        ("solver", solver_reward), ("verifier", rewards[0]), ("solver", solver_reward), ("verifier", rewards[1])]
    seen = [{"role": "system", "content": VERIFIER_PROMPT}, {"role": "user", "content": "What is 12 * 34?"},
            {"role": "user", "content": f"Answer: {shown}"}]
    assert [t.messages for t in trajectories[1::2]] == [seen + [{"role": "assistant", "content": v}] for v in verdicts]
    assert trajectories[0].messages[-1] == {"role": "assistant", "content": solver}


def test_a_frozen_verifier_judges_the_answer_of_the_rows_kind(tiny_tokenizer, make_ctx):
    """The loop tells only a sampled verifier (a frozen one has no context); the scripted judge is right."""
    row = make_row(agent="solver_verifier", verifier={"checks_right": False, "wrong_answer": 418})
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, script_by_role({"solver": ["#### 408"]})), agent={"roles": {"verifier": "frozen"}})
    [solver] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", row)], n=1))
    assert solver.reward_info["role_rewards"] == {"solver": 1.0, "verifier": 1.0}
    assert verdict_of("#### 1") is False  # what the scripted judge says of the wrong answer it checked


def test_the_demonstrations_every_fourth_a_verifier_whose_check_is_its_verdict():
    from agentrl_data_prep.solver_verifier import CHECK_FACTOR
    from agentrl_data_prep.tasks import SYSTEM_PROMPT, sft_conversations
    from agentrl_tools.calculator import evaluate

    demos = sft_conversations("solver_verifier", 80, seed=0, tool_rate=1.0 / CHECK_FACTOR)  # the verifier always checks
    solvers, verifiers = [d for k, d in enumerate(demos) if k % 4 != 3], demos[3::4]
    assert {d[0]["content"] for d in solvers} == {SYSTEM_PROMPT}
    for d in verifiers:  # one calculator call for the question minus the answer: its result is the verdict
        assert [m["role"] for m in d] == ["system", "user", "user", "assistant", "tool", "assistant"]
        assert d[0]["content"] == VERIFIER_PROMPT
        expression = d[1]["content"].removeprefix("What is ").removesuffix("?")  # the question as the solver sees it
        shown = int(d[2]["content"].removeprefix("Answer: #### "))
        [call] = d[3]["tool_calls"]
        assert call["function"] == {"name": "calculator", "arguments": {"expression": f"{expression} - {shown}"}}
        assert d[4]["content"] == str(evaluate(f"{expression} - {shown}"))  # what the tool says
        assert d[-1]["content"] == f"#### {d[4]['content']}"
        assert verdict_of(d[-1]["content"]) == (evaluate(expression) == shown)
        assert shown == evaluate(expression) or _one_digit_off(shown, evaluate(expression))
    assert [d[-1]["content"] == "#### 0" for d in verifiers].count(True) not in (0, len(verifiers))  # right and wrong
    guessing = sft_conversations("solver_verifier", 80, seed=0, tool_rate=0.0)[3::4]  # never checks: a verdict alone
    assert {tuple(m["role"] for m in d) for d in guessing} == {("system", "user", "user", "assistant")}
    assert {d[-1]["content"] for d in guessing} == {"#### 0", "#### 1"}

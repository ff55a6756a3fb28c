"""One answer comparison: the check_answer tool says "correct" exactly when the exact_number
reward is 1.0 for the same text, and whenever verl's strict GSM8K reward is 1.0."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agentrl.rewards import exact_number, gsm8k_strict, judge_number
from agentrl_tools.check_answer import CheckAnswerTool


def tool_says(answer: str, ground_truth: str) -> str:
    async def scenario() -> str:
        tool = CheckAnswerTool()
        await tool.create("i", ground_truth=ground_truth)
        return (await tool.execute("i", {"answer": answer})).text

    return asyncio.run(scenario())


def written(value: Decimal, commas: bool, dollar: bool, zeros: int, point: bool) -> str:
    """``value`` the ways a model writes a number: 1,000 / $1000 / 1000.00 / 1000."""
    sign, digits = ("-", -value) if value < 0 else ("", value)
    whole, _, frac = f"{digits:f}".partition(".")
    if commas:
        whole = f"{int(whole):,}"
    frac = (frac + "0" * zeros) if (frac or zeros) else ""
    text = f"{sign}{'$' if dollar else ''}{whole}" + (f".{frac}" if frac else "")
    return text + ("." if point else "")


VALUES = st.one_of(st.integers(-10**7, 10**7).map(Decimal), st.decimals(-10**4, 10**4, places=2, allow_nan=False))
NUMBER_TEXT = st.builds(written, VALUES, st.booleans(), st.booleans(), st.integers(0, 2), st.booleans())
WORDS = st.sampled_from(["", " ", "The answer is ", "so ", " clips", " apples.", "\n", " and then 5", "####", "#### ", "x" * 40])


@st.composite
def answer_and_truth(draw: st.DrawFn) -> tuple[str, str]:
    truth = draw(VALUES)
    # the answer mostly writes the ground truth itself (so "correct" is common), else another number
    shown = st.builds(written, st.just(truth), st.booleans(), st.booleans(), st.integers(0, 2), st.booleans())
    parts = draw(st.lists(st.one_of(WORDS, shown, NUMBER_TEXT, shown.map("#### ".__add__)), min_size=1, max_size=6))
    return "".join(parts), f"{truth:f}"


@settings(max_examples=400, deadline=None)
@given(answer_and_truth())
@example(("#### 72 and then 5", "72"))  # the strict answer wins over a later number
@example(("1.2.3", "3"))  # not a number: the old tool read ".3"
@example(("#### 1,000.", "1000"))
@example(("-.5", "-0.5"))
def test_the_tool_says_correct_exactly_when_exact_number_is_one(case):
    answer, truth = case
    reward = exact_number("openai/gsm8k", answer, truth)["score"]
    assert tool_says(answer, truth) == ("correct" if reward == 1.0 else "incorrect"), (answer, truth, reward)
    if gsm8k_strict("openai/gsm8k", answer, truth) == 1.0:  # verl's strict match is a special case
        assert reward == 1.0, (answer, truth)


@pytest.mark.parametrize(
    "answer, truth, correct",
    [
        ("#### 72 and then 5", "72", True),
        ("72 clips", "72", True),
        ("$1,000.", "1000", True),
        ("#### 24.0", "24", True),
        ("#### 23 then 24", "24", False),  # strict first, as the reward
        ("1.2.3", "3", False),
        ("-72", "72", False),
        ("seventy-two", "72", False),
    ],
)
def test_judge_number_is_the_rule_both_use(answer, truth, correct):
    assert judge_number(answer, truth).correct is correct
    assert (tool_says(answer, truth) == "correct") is correct
    assert (exact_number("x", answer, truth)["score"] == 1.0) is correct

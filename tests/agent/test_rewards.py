"""Reward functions: verl's GSM8K rule reward reproduced exactly, the forgiving exact_number,
and loading a reward by name."""

from __future__ import annotations

import math

import pytest

from agentrl.errors import PluginError
from agentrl.plugins import PluginRegistry
from agentrl.rewards import (
    exact_number,
    extract_flexible,
    extract_strict,
    gsm8k_flexible,
    gsm8k_strict,
    resolve_reward,
    score_to_float,
)

SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"


@pytest.mark.parametrize(
    "solution, strict, flexible",
    [
        (SOLUTION, "72", "72"),
        ("#### 1,000", "1000", "1,000"),  # strict removes commas, flexible keeps them (verl)
        ("The loss is #### -5", "-5", "-5"),
        ("#### 3 then #### 4", "4", "4"),  # the last one
        ("####72", None, "72"),  # strict needs the space
        ("#### 24.", "24.", "24."),  # a full stop is part of the match, as in verl
        ("The answer is 24.", None, "24."),
        ("no digits here.", None, None),  # a lone "." is not a number
        ("", None, None),
        ("#### 7 " + "x" * 300, None, None),  # only the last 300 characters are searched
        ("x" * 400 + "#### 7", "7", "7"),
    ],
)
def test_extraction_matches_verl(solution, strict, flexible):
    assert extract_strict(solution) == strict
    assert extract_flexible(solution) == flexible


@pytest.mark.parametrize(
    "solution, truth, strict, flexible",
    [
        (SOLUTION, "72", 1.0, 1.0),
        ("I think it is 72", "72", 0.0, 1.0),  # no #### -> strict finds nothing
        ("#### 70", "72", 0.0, 0.0),
        ("#### 1,000", "1000", 1.0, 0.0),
        ("#### -5", "-5", 1.0, 1.0),
        ("#### 24.0", "24", 0.0, 0.0),  # compared as text
        ("#### 72", 72, 1.0, 1.0),  # a numeric ground truth is compared as its text
    ],
)
def test_gsm8k_scores_match_verl(solution, truth, strict, flexible):
    assert gsm8k_strict("openai/gsm8k", solution, truth) == strict
    assert gsm8k_flexible("openai/gsm8k", solution, truth) == flexible


def test_format_score_is_given_only_when_an_answer_was_found():
    assert gsm8k_strict("openai/gsm8k", "#### 70", "72", format_score=0.1) == 0.1
    assert gsm8k_strict("openai/gsm8k", "70", "72", format_score=0.1) == 0.0
    assert gsm8k_strict("openai/gsm8k", "#### 72", "72", format_score=0.1) == 1.0
    assert gsm8k_flexible("openai/gsm8k", "about 70", "72", format_score=0.1) == 0.1
    assert gsm8k_flexible("openai/gsm8k", "no idea", "72", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    "solution, truth, score, strict_format, answer",
    [
        ("#### 24.0", "24", 1.0, True, "24.0"),
        ("#### 1,000", "1000", 1.0, True, "1000"),
        ("In all, 1,000.", "1000", 1.0, False, "1,000."),
        ("It is 24.", "24", 1.0, False, "24."),
        ("#### 24 but maybe 25", "24", 1.0, True, "24"),  # the strict answer wins over later numbers
        ("#### 23", "24", 0.0, True, "23"),
        ("#### 1.2.3", "123", 0.0, True, "1.2.3"),  # not a number at all
        ("nothing", "24", 0.0, False, None),
    ],
)
def test_exact_number_compares_numerically_and_reports_the_answer(solution, truth, score, strict_format, answer):
    assert exact_number("x", solution, truth) == {"score": score, "strict_format": strict_format, "answer": answer}


def test_builtin_rewards_resolve_by_name_through_entry_points():
    assert resolve_reward("gsm8k") is gsm8k_strict
    assert resolve_reward("gsm8k_flexible") is gsm8k_flexible
    assert resolve_reward("exact_number") is exact_number
    assert PluginRegistry().load("rewards", "gsm8k") is gsm8k_strict


def test_resolving_an_unknown_reward_names_the_known_ones():
    with pytest.raises(PluginError, match=r"no plugin named 'f1' in group agentrl.rewards \(known: .*exact_number, gsm8k, gsm8k_flexible"):
        resolve_reward("f1")


def test_a_reward_with_the_wrong_signature_is_refused_when_resolved(monkeypatch):
    def two_args(solution, ground_truth):
        return 1.0

    monkeypatch.setattr(PluginRegistry, "load", lambda self, group, name: two_args)
    with pytest.raises(PluginError, match=r"reward plugin 'two' must accept \(data_source, solution, ground_truth, extra_info\)"):
        resolve_reward("two")


def test_score_to_float_accepts_a_number_or_a_dict_with_score():
    assert score_to_float(1) == (1.0, {})
    assert score_to_float(0.5) == (0.5, {})
    assert score_to_float({"score": 1, "acc": True}) == (1.0, {"acc": True})
    assert score_to_float(exact_number("x", "#### 3", "3")) == (1.0, {"strict_format": True, "answer": "3"})


@pytest.mark.parametrize(
    "result, message",
    [
        ({"acc": 1.0}, "a reward function returned a dict without 'score' (keys: ['acc'])"),
        ("1.0", "a reward function returned the text '1.0'"),
        (None, "a reward function returned None, not a number"),
        ({"score": [1]}, "a reward function returned [1], not a number"),
        (math.nan, "a reward function returned a non-finite score (nan)"),
    ],
)
def test_score_to_float_refuses_what_is_not_a_score(result, message):
    with pytest.raises(PluginError) as info:
        score_to_float(result)
    assert message in str(info.value)

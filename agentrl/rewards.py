"""Built-in reward functions (entry point group ``agentrl.rewards``) and how to load one.

A reward function has verl's signature::

    compute_score(data_source, solution, ground_truth, extra_info=None) -> float | {"score": float, ...}

``gsm8k_strict`` (entry point ``gsm8k``) and ``gsm8k_flexible`` reproduce verl's GSM8K rule
reward (``verl/utils/reward_score/gsm8k.py``) exactly, so scores agree with runs made there:

* only the last 300 characters of the solution are searched (verl's bound on regex cost);
* *strict* takes the last ``#### <number>`` (regex ``#### (\\-?[0-9\\.\\,]+)``) and removes
  ``,`` and ``$``; *flexible* takes the last run of digits, ``.`` and ``,`` that is not just
  ``.``, and removes nothing;
* the answer is compared with the ground truth as text: equal -> 1.0; found but different ->
  ``format_score`` (0.0); nothing found -> 0.0. So "#### 24.0", "#### 24." and a flexible
  "1,000" do NOT match "24" / "1000", as in verl.

``exact_number`` is the forgiving variant: the strict answer if there is one, else the
flexible one, compared with the ground truth as a number (commas, ``$`` and a trailing full
stop ignored; "24.0" equals "24"). It returns a dict with the extracted answer. Its rule is
``judge_number``, which the ``check_answer`` tool uses too: the tool says "correct" exactly when
``exact_number`` would score the same text 1.0 (a property test holds them together).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Mapping, cast

from agentrl.errors import PluginError

__all__ = [
    "RewardFn",
    "SOLUTION_CLIP_CHARS",
    "extract_strict",
    "extract_flexible",
    "gsm8k_strict",
    "gsm8k_flexible",
    "exact_number",
    "NumberVerdict",
    "judge_number",
    "resolve_reward",
    "data_source_reward",
    "score_to_float",
]

RewardFn = Callable[..., "float | dict[str, Any]"]

SOLUTION_CLIP_CHARS = 300  # as verl: the final answer sits at the end of the solution
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _tail(solution: str) -> str:
    return solution[-SOLUTION_CLIP_CHARS:]


def extract_strict(solution: str) -> str | None:
    """The last ``#### <number>`` of the solution's tail, without ``,`` and ``$`` (verl)."""
    matches = _STRICT.findall(_tail(solution))
    return matches[-1].replace(",", "").replace("$", "") if matches else None


def extract_flexible(solution: str) -> str | None:
    """The last number-like run of the solution's tail, as written (verl)."""
    matches: list[str] = _NUMBER.findall(_tail(solution))
    for match in reversed(matches):
        if match not in ("", "."):
            return match
    return None


def _text_score(answer: str | None, ground_truth: Any, format_score: float) -> float:
    if answer is None:
        return 0.0
    return 1.0 if answer == str(ground_truth) else format_score


def gsm8k_strict(
    data_source: str, solution: str, ground_truth: Any, extra_info: dict[str, Any] | None = None, format_score: float = 0.0
) -> float:
    """verl's GSM8K reward, strict method: 1.0 when the last ``#### <number>`` is the ground truth."""
    return _text_score(extract_strict(solution), ground_truth, format_score)


def gsm8k_flexible(
    data_source: str, solution: str, ground_truth: Any, extra_info: dict[str, Any] | None = None, format_score: float = 0.0
) -> float:
    """verl's GSM8K reward, flexible method: 1.0 when the last number is the ground truth."""
    return _text_score(extract_flexible(solution), ground_truth, format_score)


def _as_number(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


@dataclass(frozen=True, slots=True)
class NumberVerdict:
    answer: str | None  # the strict answer if there is one, else the flexible one, as extracted
    strict_format: bool  # the answer came from a `#### <number>`
    correct: bool  # it equals the ground truth as a number


def judge_number(solution: str, ground_truth: Any) -> NumberVerdict:
    """The one numeric answer comparison: the strict (else flexible) answer of ``solution``
    equals ``ground_truth`` as a number. Used by ``exact_number`` and the ``check_answer`` tool."""
    strict = extract_strict(solution)
    answer = strict if strict is not None else extract_flexible(solution)
    got, want = _as_number(answer), _as_number(str(ground_truth))
    return NumberVerdict(answer, strict is not None, got is not None and want is not None and got == want)


def exact_number(data_source: str, solution: str, ground_truth: Any, extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """1.0 when the strict (else flexible) answer equals the ground truth as a number."""
    verdict = judge_number(solution, ground_truth)
    return {"score": 1.0 if verdict.correct else 0.0, "strict_format": verdict.strict_format, "answer": verdict.answer}


def resolve_reward(name: str, prefer: Mapping[str, Mapping[str, str]] | None = None) -> RewardFn:
    """The reward function registered as ``name`` in ``agentrl.rewards``, checked to take
    ``(data_source, solution, ground_truth, extra_info)``. ``prefer`` is ``plugins.prefer``."""
    from agentrl.plugins import PluginRegistry  # plugins import nothing of ours; keep this module light

    return _checked(f"reward plugin {name!r}", PluginRegistry(prefer).load("rewards", name))


def data_source_reward(data_source: str, prefer: Mapping[str, Mapping[str, str]] | None = None) -> RewardFn | None:
    """The reward function a plugin package declares for ``data_source`` (entry point group
    ``agentrl.data_source_rewards``, named by the data source), or None when none does."""
    from agentrl.plugins import PluginRegistry

    registry = PluginRegistry(prefer)
    if data_source not in registry.names("data_source_rewards"):
        return None
    label = f"the reward plugin declared for data source {data_source!r}"
    return _checked(label, registry.load("data_source_rewards", data_source))


def _checked(label: str, fn: Any) -> RewardFn:
    if not callable(fn):
        raise PluginError(f"{label} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind("data_source", "solution", "ground_truth", {})
    except TypeError as exc:
        raise PluginError(
            f"{label} must accept (data_source, solution, ground_truth, extra_info): {exc}"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): trust it
        pass
    return cast(RewardFn, fn)


def score_to_float(result: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's result as (score, extra info): a number, or a dict with ``"score"``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise PluginError(f"a reward function returned a dict without 'score' (keys: {sorted(result)})")
        score, extra = result["score"], {k: v for k, v in result.items() if k != "score"}
    else:
        score, extra = result, {}
    if isinstance(score, (str, bytes)):
        raise PluginError(f"a reward function returned the text {score!r}; return a number or a dict with 'score'")
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise PluginError(f"a reward function returned {score!r}, not a number or a dict with 'score'") from None
    if not math.isfinite(value):
        raise PluginError(f"a reward function returned a non-finite score ({value})")
    return value, extra

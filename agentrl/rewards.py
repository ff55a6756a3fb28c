"""Built-in reward functions (entry point group ``agentrl.rewards``).

Signature, as in verl: ``compute_score(data_source, solution, ground_truth, extra_info=None)``
returning a float or a dict with ``"score"``.

GSM8K follows verl's rule reward: *strict* takes the last ``#### <number>`` in the solution,
*flexible* the last number anywhere; commas are removed; the score is 1.0 when the extracted
text equals the ground truth, else ``format_score`` (0.0). The comparison is of text, as in
verl ("24.0" does not equal "24"); ``exact_number`` compares numerically instead.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["extract_strict", "extract_flexible", "gsm8k_strict", "gsm8k_flexible", "exact_number"]

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _clean(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def extract_strict(solution: str) -> str | None:
    matches = _STRICT.findall(solution)
    return _clean(matches[-1]) if matches else None


def extract_flexible(solution: str) -> str | None:
    for match in reversed(_NUMBER.findall(solution)):
        if match not in ("", "."):
            return _clean(match)
    return None


def _score(answer: str | None, ground_truth: Any, format_score: float) -> float:
    if answer is None:
        return 0.0
    return 1.0 if answer == str(ground_truth).replace(",", "") else format_score


def gsm8k_strict(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None, format_score: float = 0.0) -> float:
    return _score(extract_strict(solution), ground_truth, format_score)


def gsm8k_flexible(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None, format_score: float = 0.0) -> float:
    return _score(extract_flexible(solution), ground_truth, format_score)


def exact_number(data_source: str, solution: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """1.0 when the last ``#### <number>`` (else the last number) equals the ground truth
    numerically; reports which form was found."""
    strict = extract_strict(solution)
    answer = strict if strict is not None else extract_flexible(solution)
    try:
        correct = answer is not None and float(answer) == float(str(ground_truth).replace(",", ""))
    except ValueError:
        correct = False
    return {"score": 1.0 if correct else 0.0, "strict_format": strict is not None, "answer": answer}

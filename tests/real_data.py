"""The real GSM8K training file (never committed): ``$AGENTRL_GSM8K``, else
``../shared/data/gsm8k/train.jsonl`` beside the checkout. Tests that need it carry ``needs_gsm8k``:
they skip with the path on a machine without it, and in CI (``CI=true``) that skip is a failure
(``tests/conftest.py``), since CI is given the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = Path(os.environ.get("AGENTRL_GSM8K") or REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl")

needs_gsm8k = [
    pytest.mark.gsm8k,
    pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason=f"the GSM8K training file is not at {GSM8K_TRAIN} (set AGENTRL_GSM8K)"),
]

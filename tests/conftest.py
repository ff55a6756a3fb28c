"""Fixtures shared across the suite: a real tiny model (built locally, cached per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: keep torch from oversubscribing them, and keep Ray local and unauthenticated.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

from ci_skips import pytest_runtest_makereport  # noqa: E402,F401  (a hook: in CI a skip is a failure)
from tmp_hygiene import pytest_configure, pytest_sessionfinish, pytest_unconfigure  # noqa: E402,F401  (the suite's own TMPDIR; a leftover fails the run)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The ~1M-parameter tiny Qwen2 with its tokenizer and chat template (seed 0)."""
    from agentrl.tiny import tiny_model_dir as build

    return build("1m", seed=0, cache_root=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def skilled_model_dir() -> Path:
    """The tiny model taught the calculator, as agentrl ships it (read-only: copy it to change it)."""
    from agentrl.tiny import shipped_skilled_model

    path = shipped_skilled_model("calculator")
    assert path is not None, "the shipped skilled base does not match its recipe (tests/test_skilled_base.py says how to rebuild)"
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _module_weight(item) -> int:
    """Heavier modules first: the suite runs on two xdist workers, one test file per worker at a
    time (``--dist loadfile``), and a long file that starts last is the run's tail."""
    for rank, marker in enumerate(("sglang", "slow", "ray")):
        if item.get_closest_marker(marker) is not None:
            return rank
    return 3


def _measured_slow() -> frozenset[str]:
    """The ids in tests/slow_tests.txt: tests measured slow (written by scripts/slowest_tests.py --slow-list)."""
    path = Path(__file__).parent / "slow_tests.txt"
    lines = path.read_text().splitlines() if path.is_file() else []
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the quick tier (-m "not slow") sees these marks
def pytest_collection_modifyitems(session, config, items):
    measured = _measured_slow()
    for item in items:  # measured slow: its file goes with the heavy ones, and the quick tier leaves it out
        if item.nodeid in measured:
            item.add_marker(pytest.mark.slow)
    weights: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        weights[module] = min(weights.get(module, 3), _module_weight(item))
    items.sort(key=lambda item: weights[item.nodeid.split("::", 1)[0]])  # stable: a file's tests stay in order
    for item in items:  # the quick tier also leaves out what starts Ray or the real SGLang server
        if item.get_closest_marker("ray") or item.get_closest_marker("sglang"):
            item.add_marker(pytest.mark.slow)

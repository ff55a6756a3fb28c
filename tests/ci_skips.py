"""In CI (``CI=true``) a skipped test is a failure that carries the skip's reason: CI installs the
test extra, builds the SGLang CPU environment and is given the GSM8K file, so a skip there means
the install, the build or the environment broke, and a green run would hide that the test never
ran. On a developer machine a skip stays a skip, its reason printed (``pytest -rs``).

Imported by ``tests/conftest.py``; a module of its own so that ``tests/test_ci_skips.py`` can run
the rule in a fresh pytest."""

from __future__ import annotations

import os

import pytest

WHAT = {"sglang": "real-SGLang", "gsm8k": "real-GSM8K"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        what = next((WHAT[m] for m in WHAT if item.get_closest_marker(m) is not None), "a")
        report.outcome = "failed"
        report.longrepr = f"{what} test skipped in CI (CI=true), which is a failure: {reason}"

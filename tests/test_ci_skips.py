"""The CI rule of tests/ci_skips.py, run in a fresh pytest: in CI every skip fails with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from ci_skips import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "@pytest.mark.skipif(True, reason='no widget here')\ndef test_needs_a_widget():\n    pass\n\n"
        "@pytest.mark.sglang\ndef test_needs_sglang():\n    pytest.skip('no sglang venv')\n\n"
        "@pytest.mark.xfail(reason='known bug')\ndef test_known_bug():\n    assert False\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


def test_in_ci_every_skip_fails_with_its_reason_and_an_xfail_stays_an_xfail(tmp_path):
    done = run(tmp_path, "true")
    assert done.returncode == 1, done.stdout
    # a skip at setup (skipif) reports as an error, one in the test's body as a failure
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in done.stdout
    assert "a test skipped in CI (CI=true), which is a failure: Skipped: no widget here" in done.stdout
    assert "real-SGLang test skipped in CI (CI=true), which is a failure: Skipped: no sglang venv" in done.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path):
    done = run(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in done.stdout

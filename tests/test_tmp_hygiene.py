"""The temp-dir rule of tests/tmp_hygiene.py, run in a fresh pytest: the session writes under a
TMPDIR of its own, removed at the end, and an entry left in it (other than pytest's tmp_path
tree and Ray's sessions) fails the run, named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, Path]:
    outer = tmp_path / "outer"  # the machine's temp dir as the inner session sees it
    outer.mkdir()
    (tmp_path / "conftest.py").write_text(
        "from tmp_hygiene import pytest_configure, pytest_sessionfinish, pytest_unconfigure  # noqa: F401\n")
    (tmp_path / "test_some.py").write_text("import os, tempfile\nfrom pathlib import Path\n\n" + body)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS",)}
    env["TMPDIR"] = str(outer)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    return done, outer


def test_the_session_writes_under_a_temp_dir_of_its_own_and_removes_it(tmp_path):
    done, outer = run(tmp_path, (
        "def test_writes(tmp_path):\n"
        "    private = Path(os.environ['TMPDIR'])\n"
        "    assert private.name.startswith('arl-') and tempfile.gettempdir() == str(private)\n"
        "    assert tmp_path.is_relative_to(private)\n"
        "    (private / 'ray' / 'session_1').mkdir(parents=True)  # Ray's sessions are removed, not counted\n"))
    assert done.returncode == 0, done.stdout
    assert "1 passed" in done.stdout and "LEFTOVERS" not in done.stdout
    assert list(outer.iterdir()) == []


def test_an_entry_left_in_the_temp_dir_fails_the_run_and_is_named(tmp_path):
    done, outer = run(tmp_path, (
        "def test_leaves_files():\n"
        "    tempfile.mkdtemp(prefix='forgotten-')\n"
        "    tempfile.NamedTemporaryFile(prefix='socket-', delete=False).close()\n"))
    assert done.returncode == 1, done.stdout
    assert "1 passed" in done.stdout
    [line] = [line for line in done.stdout.splitlines() if "LEFTOVERS" in line]
    assert "left 2 entries in its temporary directory" in line and ": forgotten-" in line and ", socket-" in line
    assert list(outer.iterdir()) == []  # removed all the same

"""scripts/slowest_tests.py: the slowest tests from a JUnit XML file or a pytest --durations log,
and the table in docs/testing.md, which the script wrote."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slowest_tests.py"


def load():
    spec = importlib.util.spec_from_file_location("slowest_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.trainer.test_x" name="test_a[2-ranks]" time="12.5" />
<testcase classname="tests.test_y.TestGroup" name="test_b" time="30.25" />
<testcase classname="tests.agent.test_z" name="test_c" time="0.5"><skipped message="no"/></testcase>
</testsuite></testsuites>"""

LOG = """..........
============================= slowest 4 durations ==============================
40.02s call     tests/trainer/test_learning.py::test_learns
3.00s setup    tests/trainer/test_x.py::test_a[2-ranks]
9.50s call     tests/trainer/test_x.py::test_a[2-ranks]
0.50s teardown tests/trainer/test_x.py::test_a[2-ranks]
2.00s call     tests/agent/test_y.py::test_b[a b]
1417 passed in 1173.00s
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_junit_times_are_read_per_test_with_its_file_path_and_class(tmp_path):
    assert load().read(write(tmp_path / "a.xml", JUNIT)) == {"tests/trainer/test_x.py::test_a[2-ranks]": 12.5,
                                                   "tests/test_y.py::TestGroup::test_b": 30.25, "tests/agent/test_z.py::test_c": 0.5}


def test_a_durations_log_adds_up_each_tests_setup_call_and_teardown_and_the_table_is_slowest_first(tmp_path):
    module = load()
    times = module.read(write(tmp_path / "ci.log", LOG))
    assert times == {"tests/trainer/test_learning.py::test_learns": 40.02, "tests/trainer/test_x.py::test_a[2-ranks]": 13.0,
                     "tests/agent/test_y.py::test_b[a b]": 2.0}
    assert module.table(times, 1).splitlines() == ["| # | seconds | test |", "| ---: | ---: | --- |",
                                                   "| 1 | 40.0 | `tests/trainer/test_learning.py::test_learns` |"]


def test_write_replaces_only_the_table_between_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\nbefore\n<!-- slowest-tests -->\nold table\n<!-- /slowest-tests -->\nafter\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(write(tmp_path / "ci.log", LOG)), "--top", "2", "--write", str(page),
                           "--source", "run R"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{page}: the 2 slowest of 3 tests"
    assert page.read_text() == ("# T\n\nbefore\n<!-- slowest-tests -->\n3 tests timed; run R.\n\n| # | seconds | test |\n| ---: | ---: | --- |\n"
                                "| 1 | 40.0 | `tests/trainer/test_learning.py::test_learns` |\n"
                                "| 2 | 13.0 | `tests/trainer/test_x.py::test_a[2-ranks]` |\n<!-- /slowest-tests -->\nafter\n")


def test_a_file_without_durations_is_refused_naming_it(tmp_path):
    path = write(tmp_path / "empty.log", "1 passed in 1.0s\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"{path}: no test durations found" in done.stderr


def test_docs_testing_md_holds_a_table_the_script_wrote():
    text = (ROOT / "docs" / "testing.md").read_text()
    block = text.split("<!-- slowest-tests -->", 1)[1].split("<!-- /slowest-tests -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 20
    seconds = [float(row.split("|")[2]) for row in rows]
    assert seconds == sorted(seconds, reverse=True)
    assert "tests timed; " in block


def test_slow_list_holds_the_tests_over_the_threshold(tmp_path):
    listed = tmp_path / "slow.txt"
    done = subprocess.run([sys.executable, str(SCRIPT), str(write(tmp_path / "ci.log", LOG)), "--slow-list", str(listed),
                           "--over", "13", "--source", "run R"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{listed}: 2 of 3 tests took 13 s or more"
    lines = listed.read_text().splitlines()
    assert lines[0] == "# Tests marked slow by tests/conftest.py: 13 s or more in run R."
    assert lines[2:] == ["tests/trainer/test_learning.py::test_learns", "tests/trainer/test_x.py::test_a[2-ranks]"]


def test_every_test_in_the_slow_list_still_exists():
    """A renamed or moved test would silently join the quick tier: each listed id names a file that
    defines the test."""
    for line in (ROOT / "tests" / "slow_tests.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        path, *rest = line.split("::")
        name = rest[-1].split("[", 1)[0]
        assert (ROOT / path).is_file(), line
        assert f"def {name}(" in (ROOT / path).read_text(), line

"""The slowest tests of a pytest run, as a Markdown table (for docs/testing.md).

Reads either a JUnit XML file (``pytest --junitxml=FILE``: each test's setup, call and teardown
together) or a pytest log with the ``--durations`` section (``pytest --durations=20``, as
``.ci/run`` prints it: a test's setup, call and teardown lines are added up). Prints the table;
``--write docs/testing.md`` puts it between the page's ``<!-- slowest-tests -->`` markers instead,
with the line naming the source (``--source``). ``--slow-list tests/slow_tests.txt --over S``
writes the ids of the tests that took S seconds or more, which ``tests/conftest.py`` marks
``slow`` (the quick tier, ``pytest -m "not slow"``, leaves them out; CI runs them).

    .venv/bin/python -m pytest -q --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/slowest_tests.py /tmp/junit.xml --top 20 --write docs/testing.md \\
        --source "clean-clone CI of <commit>, <date>, <machine>"
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BEGIN, END = "<!-- slowest-tests -->", "<!-- /slowest-tests -->"
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")  # ids may hold spaces


def from_junit(path: Path) -> dict[str, float]:
    """Test id -> seconds, from pytest's JUnit XML (``classname`` is the module path with dots)."""
    times: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # pytest writes "tests.trainer.test_x" or "tests.trainer.test_x.TestClass": the module is the
        # longest prefix that names a file; without the checkout at hand, take test_* as the module
        module_end = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=len(parts) - 1)
        module = "/".join(parts[: module_end + 1]) + ".py"
        node = "::".join([module, *parts[module_end + 1:], name])
        times[node] = times.get(node, 0.0) + float(case.get("time", "0") or 0)
    return times


def from_durations(text: str) -> dict[str, float]:
    """Test id -> seconds, from the ``slowest durations`` lines of a pytest log."""
    times: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        found = DURATION.match(line)
        if found:
            times[found[3]] += float(found[1])
    return dict(times)


def read(path: Path) -> dict[str, float]:
    text = path.read_text(errors="replace")
    times = from_junit(path) if text.lstrip().startswith("<") else from_durations(text)
    if not times:
        raise SystemExit(f"{path}: no test durations found (a JUnit XML file, or a pytest log run with --durations=N)")
    return times


def table(times: dict[str, float], top: int) -> str:
    rows = sorted(times.items(), key=lambda item: (-item[1], item[0]))[:top]
    lines = ["| # | seconds | test |", "| ---: | ---: | --- |"]
    lines += [f"| {i} | {seconds:.1f} | `{test}` |" for i, (test, seconds) in enumerate(rows, 1)]
    return "\n".join(lines)


def write_into(page: Path, block: str) -> None:
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page}: no {BEGIN} ... {END} markers to write between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source_files", type=Path, nargs="+",
                        help="JUnit XML (pytest --junitxml) or pytest logs with --durations; several runs of different tests join")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--write", type=Path, help="a page with <!-- slowest-tests --> markers to write the table into")
    parser.add_argument("--source", default="", help="where the timings come from (run, commit, date, machine)")
    parser.add_argument("--slow-list", type=Path, help="write the ids of the tests that took --over seconds or more here")
    parser.add_argument("--over", type=float, default=5.0)
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    for path in args.source_files:
        times.update(read(path))
    if args.slow_list:
        slow = sorted(test for test, seconds in times.items() if seconds >= args.over)
        header = [f"# Tests marked slow by tests/conftest.py: {args.over:g} s or more in {args.source or ', '.join(map(str, args.source_files))}.",
                  "# Written by scripts/slowest_tests.py --slow-list; the quick tier (pytest -m 'not slow') leaves them out."]
        args.slow_list.write_text("\n".join(header + slow) + "\n")
        print(f"{args.slow_list}: {len(slow)} of {len(times)} tests took {args.over:g} s or more")
        if not args.write:
            return 0
    block = table(times, args.top)
    if args.source:
        block = f"{len(times)} tests timed; {args.source}.\n\n{block}"
    if args.write:
        write_into(args.write, block)
        print(f"{args.write}: the {min(args.top, len(times))} slowest of {len(times)} tests")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

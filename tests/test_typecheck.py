"""The type check: mypy, strict, on the modules that define the public API, with zero errors.

The configuration (which modules, which flags) is ``[tool.mypy]`` in pyproject.toml; this test
runs it as a developer would (``python -m mypy`` in the repository root), so the README's test
command is also the type check.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import agentrl

REPO = Path(__file__).resolve().parents[1]


def test_mypy_strict_finds_no_errors_in_the_public_modules():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert done.stdout.startswith("Success: no issues found"), done.stdout


def test_every_module_that_defines_a_public_name_is_type_checked_strictly():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    checked = {str(REPO / f) for f in config["files"]}
    defining = {getattr(agentrl, name).__module__ for name in agentrl.__all__ if hasattr(getattr(agentrl, name), "__module__")}
    assert "agentrl.agent.loop" in defining  # AgentLoop
    for module in sorted(defining):
        path = sys.modules[module].__file__
        assert path in checked, f"{module} defines public names but is not in [tool.mypy] files"


def test_the_package_says_it_is_typed():
    assert (Path(agentrl.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["agentrl"]
    assert "py.typed" in data

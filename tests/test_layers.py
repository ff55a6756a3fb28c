"""Imports flow one way: foundations -> data -> engines -> agent -> environments -> trainer -> replay -> cli,
with no cycles between the modules of a package (the contracts in pyproject.toml, checked by
import-linter's ``lint-imports``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"  # installed with the `test` extra


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    assert LINT_IMPORTS.is_file(), f"{LINT_IMPORTS} is missing: pip install -e '.[test]' installs import-linter"
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_the_import_layers_and_acyclic_packages_hold():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = " ".join(done.stdout.split())  # lint-imports wraps long lines at the terminal's width
    assert "layers: foundations -> data -> engines -> agent -> environments -> trainer -> replay -> cli KEPT" in report
    assert "no import cycles between the modules of a package KEPT" in report


def test_an_upward_import_and_a_cycle_break_the_contracts(tmp_path):
    shutil.copytree(REPO / "agentrl", tmp_path / "agentrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    io = tmp_path / "agentrl" / "data" / "io.py"
    io.write_text(io.read_text() + "\n\ndef _upward():\n    from agentrl.trainer.step import shards  # noqa: F401\n")
    batch = tmp_path / "agentrl" / "trainer" / "batch.py"
    batch.write_text(batch.read_text() + "\n\ndef _cycle():\n    from agentrl.trainer import sft  # noqa: F401\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "agentrl.data is not allowed to import agentrl.trainer" in done.stdout
    assert "agentrl.data.io -> agentrl.trainer.step" in done.stdout
    assert "No cycles are allowed in agentrl.trainer." in done.stdout

"""The mutation check (``scripts/mutation_check.py``, table in docs/testing.md) stays runnable.

The full check runs by hand (each mutation runs its own tests: minutes). CI holds what would
make it rot silently: every mutation's text still occurs exactly once where it points, its tests
exist, the docs table lists exactly the script's mutations, and one mutation applied for real
(in a copy of the checkout, since other test files import the same sources meanwhile) is caught
and its file put back byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_once_and_names_existing_tests():
    mutations = _script().MUTATIONS
    assert len(mutations) >= 15 and len({m.name for m in mutations}) == len(mutations)
    for m in mutations:
        source = (ROOT / m.file).read_text()
        assert source.count(m.old) == 1, f"{m.name}: its text occurs {source.count(m.old)} times in {m.file}"
        assert m.new != m.old, m.name
        assert m.tests and all((ROOT / t.split("::")[0]).is_file() for t in m.tests), m.name


def test_the_docs_table_lists_exactly_the_scripts_mutations():
    table = (ROOT / "docs" / "testing.md").read_text().split("## The mutation check", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    assert sorted(documented) == sorted(m.name for m in _script().MUTATIONS)


def test_a_mutation_applied_for_real_is_caught_and_the_file_restored(tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", ".mypy_cache", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "outputs", "docs"))
    mutation = next(m for m in _script().MUTATIONS if m.name == "kl_k3_drops_the_minus_one")
    target = copy / mutation.file
    before = target.read_bytes()
    done = subprocess.run([sys.executable, str(copy / "scripts" / "mutation_check.py"), "--only", "kl_k3_drops_the_minus_one"],
                          cwd=copy, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[0]["outcome"] == "caught" and lines[0]["caught_by"], lines
    assert "test_kl_estimators" in lines[0]["caught_by"][0]
    assert lines[-1] == {"mutations": 1, "caught": 1, "not_caught": []}
    assert target.read_bytes() == before

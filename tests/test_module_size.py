"""No module of the package or of the built-in plugins grows past ``MAX_LINES``: a module that
long holds more than one concern, and is split along its seams (as ``engines/builtin.py``,
``trainer/workers.py`` and ``trainer/algorithms.py`` were) before it grows further."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("agentrl", "agent_loops", "tools", "interactions")
MAX_LINES = 600


def oversized(repo: Path, roots: tuple[str, ...], limit: int) -> dict[str, int]:
    """Every ``.py`` file under ``roots`` with more than ``limit`` lines, with its line count."""
    found = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found[str(path.relative_to(repo))] = lines
    return found


def test_no_module_is_longer_than_the_limit():
    too_long = oversized(REPO, ROOTS, MAX_LINES)
    assert not too_long, (
        f"modules over {MAX_LINES} lines (split each along its seams into modules of one concern): "
        + ", ".join(f"{path} ({lines})" for path, lines in too_long.items())
    )


def test_the_scan_reports_a_long_module_in_a_subpackage_and_passes_one_at_the_limit(tmp_path):
    package = tmp_path / "agentrl" / "sub"
    package.mkdir(parents=True)
    (package / "long.py").write_text("x = 1\n" * 601)
    (package / "at_limit.py").write_text("x = 1\n" * 600)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "notes.txt").write_text("x\n" * 700)  # not a module
    assert oversized(tmp_path, ("agentrl", "tools"), 600) == {str(Path("agentrl/sub/long.py")): 601}

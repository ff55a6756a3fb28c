"""Wheels built from this checkout for the install tests (no network: --no-build-isolation)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_wheel(source: Path, dest: Path, *, copy: list[str] | None = None) -> Path:
    """The wheel of the project in ``source`` (built in a copy of ``copy``, or of the whole
    folder: setuptools leaves build/ and *.egg-info where it runs), written to ``dest``."""
    work = dest / f"src-{source.name}"
    skip = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    if copy is None:
        shutil.copytree(source, work, ignore=skip)
    else:
        work.mkdir(parents=True)
        for name in copy:
            if (source / name).is_dir():
                shutil.copytree(source / name, work / name, ignore=skip)
            else:
                shutil.copy(source / name, work / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(work)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    name = tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"].replace("-", "_")
    [wheel] = dest.glob(f"{name}-*.whl")
    return wheel


def agentrl_wheel(dest: Path) -> Path:
    """agentrl's own wheel: pyproject, README and every package folder."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return build_wheel(REPO, dest, copy=["pyproject.toml", "README.md", "agentrl", *setuptools["package-dir"].values()])

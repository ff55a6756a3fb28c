"""The benchmarks live outside the library: installed as ``agentrl_benchmarks``, reached from
``agentrl bench`` through the table of targets only, and never imported by ``agentrl``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agentrl import cli

REPO = Path(__file__).resolve().parents[2]
MODULES = ("engine", "agent_loop", "trainer", "forward", "data_reader")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            names.update(arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
    return names


def test_nothing_in_the_library_imports_the_benchmarks():
    offenders = {
        f"{path.relative_to(REPO)}: {name}"
        for path in (REPO / "agentrl").rglob("*.py")
        for name in _imported_modules(path)
        if name.split(".")[0] in ("agentrl_benchmarks", "benchmarks")
    }
    assert offenders == set()


def test_no_bench_module_is_left_in_the_library():
    assert sorted(p.relative_to(REPO).as_posix() for p in (REPO / "agentrl").rglob("*bench*.py")) == []


def test_every_bench_command_targets_a_main_in_the_benchmarks_package():
    assert set(cli.BENCHMARKS) == {"engine", "agent-loop", "trainer", "forward"}
    for name, target in cli.BENCHMARKS.items():
        module, _, func = target.partition(":")
        assert module.startswith("agentrl_benchmarks.") and func == "main", name
        assert callable(cli._resolve(target)), name


@pytest.mark.parametrize("name", ["engine", "agent-loop", "trainer", "forward"])
def test_bench_command_help_names_the_command(name):
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", name, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: agentrl bench {name} ")
    assert "--json" in out.stdout


def test_bench_without_a_known_benchmark_prints_usage():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", "engien"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "usage: agentrl bench {engine|agent-loop|trainer|forward}" in out.stderr


def test_a_wheel_carries_the_benchmarks_under_their_installed_name_and_runs_them(tmp_path):
    """Built and installed like a user's ``pip install agentrl``, away from the repository."""
    source, wheels, target = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    # a copy: building in place would write build/ and egg-info into the repository
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "runs", "tests", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheels.glob("agentrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"agentrl_benchmarks/{m}.py" for m in ("__init__", *MODULES)} <= names
    assert not any(n.startswith("benchmarks/") for n in names)  # never the generic folder name
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", target, wheel],
        check=True, capture_output=True, timeout=300,
    )
    probe = "import agentrl_benchmarks.agent_loop as m, agentrl.cli as c; print(m.__file__); print(c.__file__)"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert [Path(line).is_relative_to(target) for line in where.stdout.split()] == [True, True]  # the wheel's copy
    run = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "bench", "agent-loop", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.startswith("usage: agentrl bench agent-loop"), run.stderr[-2000:]

"""The benchmarks live outside the library: installed as ``agentrl_benchmarks``, reached from
``agentrl bench`` through the table of targets only, and never imported by ``agentrl``."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
import zipfile
from pathlib import Path

import pytest

from agentrl import cli

REPO = Path(__file__).resolve().parents[2]
MODULES = ("engine", "agent_loop", "trainer", "trainer_calculator", "first_turn", "race_batch", "forward", "lora", "scaling", "data_reader")


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
    assert set(cli.BENCHMARKS) == {"engine", "agent-loop", "trainer", "forward", "lora", "scaling", "export", "async", "history"}
    for name, target in cli.BENCHMARKS.items():
        module, _, func = target.partition(":")
        assert module.startswith("agentrl_benchmarks.") and func == "main", name
        assert callable(cli._resolve(target)), name


@pytest.mark.parametrize("name", ["engine", "agent-loop", "trainer", "forward", "lora", "scaling", "export", "async", "history"])
def test_bench_command_help_names_the_command(name):
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", name, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: agentrl bench {name} ")
    assert "--json" in out.stdout


def test_bench_without_a_known_benchmark_prints_usage():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", "engien"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "usage: agentrl bench {engine|agent-loop|trainer|forward|lora|scaling|export|async|history}" in out.stderr


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


FIGURE = re.compile(
    r"\d[\d,.]*\s?(ms|µs|tok/s|tokens/s|GFLOP/s|GB of|GB RSS|MiB above)\b"
    r"|\d[\d,.-]*\s?[x×]\s+(faster|slower)"
    r"|\d[\d.]*\s?[x×]\s+(static|SGLang|TRL)"
)


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the comments and docstrings of a Python file, the comments of a YAML file."""
    text = path.read_text()
    if path.suffix == ".yaml":
        return [(n, line.partition("#")[2]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            first = node.body[0]
            out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def test_no_benchmark_figures_in_code_comments():
    """Figures go stale in comments; they live in docs/benchmarks.md, the code keeps the reason."""
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for folder in ("agentrl", "agent_loops", "tools", "interactions", "data_prep", "configs", "benchmarks")
        for path in sorted((REPO / folder).rglob("*"))
        if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts
        for number, line in _prose(path)
        if FIGURE.search(line)
    ]
    assert found == []


def test_the_figure_pattern_sees_the_figures_that_were_moved_out():
    for moved in ("an 18M-parameter step takes 12 ms", "1,553 and 201 tok/s", "bf16 is 14-25x slower there",
                  "ran about 1.5x slower", "2.87× static", "about 3.5 GB RSS together", "reserves ~15 GB of KV cache"):
        assert FIGURE.search(moved), moved


def test_docs_benchmarks_names_every_command_it_documents():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for name in cli.BENCHMARKS:
        assert f"agentrl bench {name} --json" in text, name
    assert "python -m agentrl_benchmarks.data_reader" in text

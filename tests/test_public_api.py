"""The public API: every name in ``agentrl.__all__`` resolves, and importing agentrl is cheap."""

from __future__ import annotations

import subprocess
import sys

import agentrl


def test_every_public_name_resolves():
    for name in agentrl.__all__:
        assert getattr(agentrl, name) is not None, name


def test_unknown_attribute_raises_attribute_error():
    try:
        agentrl.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "no attribute 'NoSuchThing'" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_every_error_in_the_errors_module_is_public():
    import agentrl.errors as errors

    assert set(errors.__all__) <= set(agentrl.__all__)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AgentrlError)


def test_import_agentrl_does_not_import_torch_or_ray():
    code = "import sys, agentrl, agentrl.cli; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
SUBPACKAGES = ["agentrl", "agentrl.agent", "agentrl.engines", "agentrl.replay", "agentrl.config"]
# engine implementations are chosen by config, never subclassed: they stay in agentrl.engines
# (BuiltinEngine imports torch, which `import agentrl` must not); the public seam is agentrl.Engine
ENGINE_IMPLEMENTATIONS = {"BuiltinEngine", "SGLangEngine"}


def test_every_class_the_readme_and_the_docs_name_resolves_and_is_exported():
    import importlib
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        references = set(re.findall(r"\b(agentrl(?:\.[a-z_]+)*)\.([A-Z][a-z]\w*)", page.read_text()))
        if page.name == "README.md":
            assert ("agentrl", "AgentLoop") in references  # the scan finds what the plugin tour shows
        where = page.relative_to(REPO)
        for module, name in sorted(references):
            assert hasattr(importlib.import_module(module), name), f"{where} names {module}.{name}, which does not exist"
            assert name in agentrl.__all__ or name in ENGINE_IMPLEMENTATIONS, f"{where} shows {name}, not in agentrl.__all__"


def test_public_exports_are_plain_imports_that_a_type_checker_sees():
    import ast
    import importlib

    for package in SUBPACKAGES:
        module = importlib.import_module(package)
        assert not hasattr(module, "__getattr__"), f"{package} resolves names lazily"
        tree = ast.parse(open(module.__file__).read())
        imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
        for name in module.__all__:
            assert name in imported or name == "__version__", f"{package}.{name} is in __all__ but not imported there"


def test_importing_the_subpackages_does_not_import_torch():
    code = "import sys, " + ", ".join(SUBPACKAGES) + "; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_engine_boundary_types_import_without_torch():
    code = (
        "import sys; from agentrl.engines.base import GenerateRequest, GenerateResult, SamplingParams, Engine; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_worker_died_and_not_available_are_agentrl_errors():
    from agentrl.cli import NotAvailable as FromCli
    from agentrl.errors import WorkerDied

    assert WorkerDied is agentrl.WorkerDied and issubclass(WorkerDied, agentrl.AgentrlError)
    assert FromCli is agentrl.NotAvailable and issubclass(FromCli, agentrl.AgentrlError)


# exceptions that never reach a caller of agentrl, so they need not be AgentrlErrors
INTERNAL_EXCEPTIONS = {
    "EpisodeEnd": "control flow: raised inside a loop's play(), caught by AgentLoop as a finish reason",
    "InteractionFailure": "control flow: an interaction's exception, turned into the finish reason interaction_error",
    "BadRequest": "inside `agentrl serve`: answered as HTTP 400, never raised to a client",
    "RequestRefused": "inside the OpenAI endpoint: answered as an HTTP error body naming the field, never raised to a client",
    "BuildError": "the real-SGLang test environment builder (scripts, test fixtures), not the library",
    "_BodyTooLarge": "inside the servers' request guard: answered as HTTP 413, never raised to a client",
    "_UndecodableField": "inside data/io.py: turned into a DataError naming the file, row and field",
}


def test_every_exception_agentrl_raises_is_an_agentrl_error():
    """httpx's rule: one tree. Every exception class in the package source is an AgentrlError,
    or listed above with the reason it never reaches a caller."""
    import ast
    import importlib
    import tomllib

    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {"agentrl": "agentrl", **{folder: name for name, folder in package_dir.items()}}
    outside = []
    for folder, package in folders.items():
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
            if not classes:
                continue
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            module = importlib.import_module(".".join((package, *parts)).removesuffix(".__init__"))
            for name in classes:
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, agentrl.AgentrlError):
                    if name not in INTERNAL_EXCEPTIONS:
                        outside.append(f"{module.__name__}.{name}")
    assert not outside, f"exceptions outside AgentrlError: {outside}"


def test_write_rows_is_public_and_writes_rows_the_dataset_reads_back(tmp_path):
    """A plugin package writes its data source's rows with the public writer (docs/plugins.md);
    importing it costs no pyarrow until it is called."""
    import agentrl.data
    from agentrl.data.dataset import parse_row, validate_files
    from agentrl.data.io import iter_raw_rows

    assert "write_rows" in agentrl.__all__ and agentrl.write_rows is agentrl.data.write_rows
    assert "write_rows" in agentrl.data.__all__
    row = {"data_source": "shout/words", "prompt": [{"role": "user", "content": "Say hi loudly."}],
           "reward_model": {"ground_truth": "HI"}, "extra_info": {"index": 0, "tools_kwargs": {"shout": {"create_kwargs": {"n": 1}}}}}
    path = agentrl.write_rows([row], tmp_path / "rows.parquet")
    assert validate_files([str(path)]) == []
    ((index, raw),) = iter_raw_rows(path)
    read = parse_row(raw, file=str(path), index=index)
    assert read.extra_info.tools_kwargs["shout"].create_kwargs == {"n": 1}
    code = "import sys, agentrl; print('pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]

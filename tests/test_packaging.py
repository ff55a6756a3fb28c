"""What `pip install` puts into an environment, and the CLI's front door."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _folder_of(package: str) -> Path:
    top, _, rest = package.partition(".")
    folder = SETUPTOOLS["package-dir"].get(top, top)
    return REPO / folder / rest.replace(".", "/") if rest else REPO / folder


def test_every_package_folder_is_listed_for_installation():
    listed = {str(_folder_of(p).relative_to(REPO)) for p in SETUPTOOLS["packages"]}
    roots = {"agentrl"} | set(SETUPTOOLS["package-dir"].values())
    on_disk = {
        str(init.parent.relative_to(REPO))
        for root in roots
        for init in (REPO / root).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk - listed == set(), "package folders missing from pyproject's packages list"


def test_no_generic_top_level_names_are_installed():
    top_level = {p.split(".")[0] for p in SETUPTOOLS["packages"]}
    assert top_level <= {"agentrl"} | {name for name in top_level if name.startswith("agentrl_")}
    for generic in ("tools", "interactions", "agent_loops", "configs", "data_prep"):
        assert generic not in top_level


def test_builtin_plugin_folders_import_under_their_installed_names():
    for name, folder in SETUPTOOLS["package-dir"].items():
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == REPO / folder


def test_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("train", "sft", "rollout", "replay", "serve", "bench", "tools", "plugins", "data"):
        assert f"  {command} " in out.stdout


def test_cli_rejects_an_unknown_command_with_usage():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "trian"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown command 'trian'" in out.stderr


def test_cli_reports_config_errors_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "data.train_batch_sise=8"], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "data.train_batch_sise: unknown key; did you mean data.train_batch_size?" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_command_whose_module_is_missing_says_so_without_a_traceback(monkeypatch):
    from agentrl import cli

    monkeypatch.setitem(cli.COMMANDS, "later", ("agentrl.not_written_yet:cli_main", "a future command"))
    assert cli.main(["later"]) == 1


def test_train_refuses_an_engine_setting_it_cannot_honour_before_any_work(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "engine=sglang", "engine.weight_sync=nccl", f"trainer.runs_root={tmp_path}"],
        capture_output=True, text=True,
    )
    assert out.returncode == 1
    assert "engine.weight_sync: nccl needs GPUs for the trainer and the servers" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was started or written


def test_the_wheel_carries_the_typing_marker_the_configs_and_the_shipped_base(tmp_path):
    import zipfile

    from wheels import agentrl_wheel

    wheel = agentrl_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"agentrl/py.typed", "agentrl_configs/train.yaml", "agentrl_configs/engine/sglang.yaml"} <= names
    shipped = "agentrl/tiny_models/1m-seed0-calculator/"  # the quickstart's base, whole
    assert {shipped + f for f in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja", "recipe.json")} <= names

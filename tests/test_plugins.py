"""Plugin discovery for the built-ins: agentrl registers its own loops, tools, interactions,
rewards and parsers through the same entry points as any third-party package (the third-party
side, with a real distribution, is tests/test_plugin_dist.py)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import agentrl.plugins as plugins
from agentrl.agent.interaction import Interaction
from agentrl.agent.loop import AgentLoop
from agentrl.agent.tool import Tool
from agentrl.errors import PluginError
from agentrl.plugins import GROUPS, PluginRegistry, PluginSpec, discover

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
BASE_CLASS = {
    "agentrl.agent_loops": AgentLoop,
    "agentrl.tools": Tool,
    "agentrl.interactions": Interaction,
}


def agentrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=60)


def test_installed_entry_points_are_exactly_those_in_pyproject():
    # fails when the editable install is stale: run `pip install -e . --no-deps` after editing them
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    expected = {(group, name, target) for group, entries in declared.items() for name, target in entries.items()}
    installed = {(s.group, s.name, s.target) for s in discover() if s.distribution == "agentrl"}
    assert installed == expected
    # every group has built-ins except data_source_rewards: a declared reward would override
    # reward.default for that data source, which agentrl's own data must not do; and environments:
    # agentrl ships none (they are the user's installed verifiers / OpenEnv / TRL environments)
    assert {group for group, _, _ in expected} == set(GROUPS) - {"agentrl.data_source_rewards", "agentrl.environments"}


def test_every_builtin_plugin_loads_and_has_its_kind():
    registry = PluginRegistry()
    builtins = [s for s in discover() if s.distribution == "agentrl"]
    for spec in builtins:
        obj = registry.load(spec.group, spec.name)
        if spec.group == "agentrl.rewards":
            inspect.signature(obj).bind("openai/gsm8k", "#### 1", "1", {})
        elif spec.group == "agentrl.tool_parsers":  # a Protocol: check its one method
            assert callable(getattr(obj(), "parse", None)), spec
        elif spec.group == "agentrl.agents":  # a function of one AgentTask
            inspect.signature(obj).bind(object())
        else:
            assert isinstance(obj, type) and issubclass(obj, BASE_CLASS[spec.group]), spec
    assert {s.name for s in builtins if s.group == "agentrl.tools"} >= {"calculator", "check_answer"}


def test_plugins_list_json_prints_group_name_target_distribution():
    out = agentrl("plugins", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows and all(list(row) == ["group", "name", "target", "distribution"] for row in rows)
    assert {"group": "agentrl.tools", "name": "calculator", "target": "agentrl_tools.calculator:CalculatorTool", "distribution": "agentrl"} in rows
    assert {"group": "agentrl.rewards", "name": "gsm8k", "target": "agentrl.rewards:gsm8k_strict", "distribution": "agentrl"} in rows
    assert rows == sorted(rows, key=lambda r: (r["group"], r["name"], r["distribution"]))


def test_plugins_list_filters_by_group_and_check_reports_each_plugin():
    out = agentrl("plugins", "list", "--json", "--group", "interactions", "--check")
    assert out.returncode == 0, out.stderr
    rows = [r for r in json.loads(out.stdout) if r["distribution"] == "agentrl"]
    assert rows == [{"group": "agentrl.interactions", "name": "gsm8k", "target": "agentrl_interactions.gsm8k:Gsm8kInteraction", "distribution": "agentrl", "error": None}]


def test_listing_plugins_imports_none_of_them_nor_torch():
    code = (
        "import sys, io, contextlib\n"
        "from agentrl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['plugins', 'list', '--json'])\n"
        "print(sorted(m for m in ('torch', 'ray', 'agentrl_tools', 'agentrl_agent_loops', 'agentrl_interactions') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_verl_loop_names_are_aliases():
    registry = PluginRegistry()
    assert registry.canonical("agent_loops", "single_turn_agent") == "single_turn"
    assert registry.load("agent_loops", "single_turn_agent") is registry.load("agent_loops", "single_turn")
    assert registry.load("agent_loops", "tool_agent").name == "tool_agent"  # verl's other name is ours


def test_unknown_group_and_unknown_name_list_what_exists():
    with pytest.raises(PluginError, match=r"unknown plugin group 'widgets'; groups are agentrl.agent_loops, agentrl.tools, "):
        discover("widgets")
    with pytest.raises(PluginError, match=r"no plugin named 'abacus' in group agentrl.tools \(known: calculator, check_answer"):
        PluginRegistry().load("tools", "abacus")


def fake_specs(monkeypatch, *extra: PluginSpec) -> None:
    """The installed plugins plus ``extra`` declarations (targets may be real or broken)."""
    real = plugins._scan()
    monkeypatch.setattr(plugins, "_scan", lambda: tuple(real) + extra)


@pytest.mark.parametrize(
    "target, cause",
    [
        ("agentrl_no_such_module:Tool", "ModuleNotFoundError: No module named 'agentrl_no_such_module'"),
        ("agentrl_tools.calculator:NoSuchTool", "AttributeError"),
    ],
)
def test_a_plugin_that_fails_to_load_is_named_and_the_others_still_load(monkeypatch, target, cause):
    fake_specs(monkeypatch, PluginSpec("agentrl.tools", "ghost", target, "ghostpkg"))
    registry = PluginRegistry()
    with pytest.raises(PluginError) as info:
        registry.load("tools", "ghost")
    message = str(info.value)
    assert f"plugin 'ghost' in group agentrl.tools (entry point ghost = {target}, distribution ghostpkg) failed to load: " in message
    assert cause in message
    assert registry.load("tools", "calculator").name == "calculator"
    # agentrl's tools and the ghost (a plugin package installed beside agentrl may have broken ones of its own)
    assert [spec.name for spec, error in registry.check("tools") if error is not None and spec.distribution in ("agentrl", "ghostpkg")] == ["ghost"]


def test_two_distributions_with_one_name_need_a_preference(monkeypatch):
    fake_specs(monkeypatch, PluginSpec("agentrl.rewards", "gsm8k", "agentrl.rewards:exact_number", "otherpkg"))
    with pytest.raises(PluginError) as info:
        PluginRegistry().load("rewards", "gsm8k")
    assert "offered by several distributions (agentrl, otherpkg); choose one with plugins.prefer.rewards.gsm8k=<distribution>" in str(info.value)
    assert PluginRegistry({"rewards": {"gsm8k": "otherpkg"}}).load("rewards", "gsm8k").__name__ == "exact_number"
    assert PluginRegistry({"rewards": {"gsm8k": "agentrl"}}).load("rewards", "gsm8k").__name__ == "gsm8k_strict"
    assert PluginRegistry().load("rewards", "gsm8k_flexible").__name__ == "gsm8k_flexible"  # other names unaffected

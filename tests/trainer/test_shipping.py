"""What a job ships to the nodes of a cluster it joins (``agentrl/trainer/shipping.py``): the
packages under the names the workers import, and the plugin table the workers resolve with.
The run that needs both on other nodes: ``test_cluster_train.py``."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl import plugins
from agentrl.plugins import PLUGIN_TABLE_ENV, discover
from agentrl.trainer.shipping import plugin_table, shipped_modules, should_ship


def test_every_shipped_package_is_named_as_it_is_imported(tmp_path):
    shipped = {Path(p).name: Path(p) for p in shipped_modules(tmp_path)}
    tops = {spec.target.split(":")[0].split(".")[0] for spec in discover()}
    assert {"agentrl", "agentrl_agent_loops", "agentrl_tools", "agentrl_interactions", "agentrl_agent_programs"} <= tops
    assert set(shipped) == tops | {"agentrl"}
    # agent_loops/ is imported as agentrl_agent_loops: shipped as a staged copy of that name
    loops = shipped["agentrl_agent_loops"]
    assert loops.parent == tmp_path
    source = Path(__import__("agentrl_agent_loops").__file__).parent
    assert sorted(p.name for p in loops.glob("*.py")) == sorted(p.name for p in source.glob("*.py"))
    assert not list(loops.rglob("__pycache__"))
    assert shipped["agentrl"] == Path(__import__("agentrl").__file__).parent.resolve()  # named as imported: as it is


def test_workers_resolve_plugins_with_the_drivers_table(monkeypatch):
    table = json.loads(plugin_table())
    assert {"group": "agentrl.tools", "name": "calculator", "target": "agentrl_tools.calculator:CalculatorTool",
            "distribution": "agentrl"} in table
    only = [{"group": "agentrl.rewards", "name": "shipped", "target": "some_module:reward", "distribution": "x"}]
    monkeypatch.setenv(PLUGIN_TABLE_ENV, json.dumps(only))
    plugins.refresh()
    try:
        # the driver's table replaces this process's own metadata, whatever is installed here
        assert [s.as_dict() for s in discover()] == only
    finally:
        monkeypatch.delenv(PLUGIN_TABLE_ENV)
        plugins.refresh()
    assert len(discover()) == len(table)


def test_code_ships_when_joining_a_cluster_unless_told_otherwise():
    assert should_ship("auto", joining=True) and not should_ship("auto", joining=False)
    assert should_ship("always", joining=False) and not should_ship("never", joining=True)

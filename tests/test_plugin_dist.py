"""Third-party plugins through real distribution metadata.

The throwaway distribution ``myplugin`` (source: ``tests/fixtures/plugin_dist/``) is installed
unpacked on a temporary path - its modules next to a ``myplugin-0.1.dist-info`` written from
its ``pyproject.toml``, the layout pip leaves in site-packages - and never imported by hand:
agentrl finds it through ``importlib.metadata``, in this process, in subprocesses (the CLI) and
in a Ray actor. The tests see agentrl's and its plugins alone: the table of the two
distributions, read from their metadata, is what every process here resolves names with
(``PLUGIN_TABLE_ENV``), so a plugin package the reader installed (the README's offers a tool
named ``shout``) changes no result. It adds a tool, an interaction and an agent loop, a tool that
fails, a tool whose name collides with a built-in, a tool and a reward whose module cannot be imported,
and agent programs that fail (``tests/test_program_setup.py``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import agentrl.plugins as plugins
from agentrl.data.row import Row
from agentrl.errors import PluginError
from agentrl.plugins import PLUGIN_TABLE_ENV, PluginRegistry

FIXTURE = Path(__file__).parent / "fixtures" / "plugin_dist"
MINE = {
    ("agentrl.tools", "holler"), ("agentrl.tools", "explode"), ("agentrl.tools", "calculator"), ("agentrl.tools", "telescope"),
    ("agentrl.interactions", "always_right"), ("agentrl.agent_loops", "one_shot"), ("agentrl.rewards", "broken"),
    ("agentrl.data_source_rewards", "myplugin/shouting"), ("agentrl.agents", "absent_at_import"), ("agentrl.agents", "absent_at_call"),
    ("agentrl.agents", "gives_up"),
}


def install_unpacked(source: Path, site: Path) -> Path:
    """Lay out ``source`` (a pyproject.toml project of top-level modules) as an installed
    distribution in ``site``: the modules plus ``<name>-<version>.dist-info``."""
    pyproject = tomllib.loads((source / "pyproject.toml").read_text())
    project = pyproject["project"]
    site.mkdir(parents=True)
    files = []
    for module in pyproject["tool"]["setuptools"]["py-modules"]:
        shutil.copy(source / f"{module}.py", site)
        files.append(f"{module}.py")
    info = site / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
            for group, entries in project["entry-points"].items()
        )
    )
    files += [f"{info.name}/METADATA", f"{info.name}/entry_points.txt", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install_unpacked(FIXTURE, tmp_path_factory.mktemp("plugin-dist") / "site")


@functools.lru_cache(maxsize=None)
def plugin_table(site: Path) -> str:
    """The plugins of agentrl and myplugin (on ``site``) alone, as found in their installed
    metadata: the table every process of these tests resolves names with."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PLUGIN_TABLE_ENV, raising=False)
        patch.syspath_prepend(str(site))
        plugins.refresh()  # the scan of installed metadata is cached per process
        table = [spec.as_dict() for spec in plugins.discover() if spec.distribution in ("agentrl", "myplugin")]
    plugins.refresh()
    return json.dumps(table)


@pytest.fixture
def dist_path(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(PLUGIN_TABLE_ENV, plugin_table(site))
    plugins.refresh()
    yield site
    monkeypatch.undo()
    plugins.refresh()


def agentrl(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
           PLUGIN_TABLE_ENV: plugin_table(site)}
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_distribution_is_found_through_its_metadata_once_its_path_is_on_sys_path(site, monkeypatch):
    monkeypatch.delenv(PLUGIN_TABLE_ENV, raising=False)
    plugins.refresh()
    assert not any(spec.distribution == "myplugin" for spec in plugins.discover())
    monkeypatch.syspath_prepend(str(site))
    plugins.refresh()
    try:
        assert {(s.group, s.name) for s in plugins.discover() if s.distribution == "myplugin"} == MINE
    finally:
        monkeypatch.undo()
        plugins.refresh()


def test_a_plugin_package_the_reader_installed_changes_nothing_here(dist_path, tmp_path):
    """The README's own example (a tool named ``shout``) installed beside agentrl: not in the table."""
    readers = install_unpacked(FIXTURE, tmp_path / "readers")  # the same plugins again, as another distribution
    (readers / "myplugin-0.1.dist-info").rename(readers / "my_pkg-0.1.dist-info")
    metadata_file = readers / "my_pkg-0.1.dist-info" / "METADATA"
    metadata_file.write_text(metadata_file.read_text().replace("Name: myplugin", "Name: my_pkg"))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(readers))
        plugins.refresh()
        assert PluginRegistry().spec("tools", "holler").distribution == "myplugin"  # the table's
        patch.delenv(PLUGIN_TABLE_ENV)  # without it, the reader's package would collide with the fixture's
        plugins.refresh()
        with pytest.raises(PluginError, match=r"plugin name 'holler' in group agentrl.tools is offered by several distributions \(my_pkg, myplugin\)"):
            PluginRegistry().spec("tools", "holler")
    plugins.refresh()


def test_plugins_list_json_shows_the_distribution(dist_path):
    out = agentrl(dist_path, "plugins", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert all(set(row) == {"group", "name", "target", "distribution"} for row in rows)
    assert {(r["group"], r["name"]) for r in rows if r["distribution"] == "myplugin"} == MINE
    assert {"group": "agentrl.agent_loops", "name": "one_shot", "target": "myplugin_mod:OneShotLoop", "distribution": "myplugin"} in rows
    assert {"group": "agentrl.tools", "name": "calculator", "target": "agentrl_tools.calculator:CalculatorTool", "distribution": "agentrl"} in rows


def test_plugins_list_check_flags_only_the_broken_plugin(dist_path):
    out = agentrl(dist_path, "plugins", "list", "--json", "--check")
    assert out.returncode == 1  # something is broken
    broken = {(r["group"], r["name"], r["distribution"]): r["error"] for r in json.loads(out.stdout) if r["error"] is not None}
    assert sorted(broken) == [("agentrl.agents", "absent_at_import", "myplugin"), ("agentrl.rewards", "broken", "myplugin"),
                              ("agentrl.tools", "telescope", "myplugin")]
    assert "entry point broken = myplugin_broken:compute_score, distribution myplugin" in broken[("agentrl.rewards", "broken", "myplugin")]


def test_tool_interaction_and_loop_from_the_distribution_resolve(dist_path):
    from agentrl.agent.interaction import Interaction
    from agentrl.agent.loop import AgentLoop
    from agentrl.agent.tool import Tool

    registry = PluginRegistry()
    tool_cls = registry.load("tools", "holler")
    result = asyncio.run(tool_cls().execute("i", {"text": "hi"}))
    assert (result.text, result.reward, result.metrics) == ("HI", 0.25, {"chars": 2.0})
    assert issubclass(tool_cls, Tool)
    assert issubclass(registry.load("interactions", "always_right"), Interaction)
    loop_cls = registry.load("agent_loops", "one_shot")
    assert issubclass(loop_cls, AgentLoop) and loop_cls.name == "one_shot"


def test_broken_plugin_is_named_and_isolated(dist_path):
    registry = PluginRegistry()
    with pytest.raises(PluginError) as info:
        registry.load("rewards", "broken")
    assert str(info.value) == (
        "plugin 'broken' in group agentrl.rewards (entry point broken = myplugin_broken:compute_score, "
        "distribution myplugin) failed to load: ImportError: this plugin is broken on purpose"
    )
    assert registry.load("rewards", "gsm8k").__name__ == "gsm8k_strict"  # the others still load
    assert registry.load("tools", "holler").name == "holler"


def test_duplicate_name_is_an_error_until_the_config_chooses(dist_path):
    with pytest.raises(PluginError) as info:
        PluginRegistry().load("tools", "calculator")
    assert str(info.value) == (
        "plugin name 'calculator' in group agentrl.tools is offered by several distributions (agentrl, myplugin); "
        "choose one with plugins.prefer.tools.calculator=<distribution>"
    )
    assert PluginRegistry({"tools": {"calculator": "agentrl"}}).load("tools", "calculator").__module__ == "agentrl_tools.calculator"
    assert PluginRegistry({"agentrl.tools": {"calculator": "myplugin"}}).load("tools", "calculator").__name__ == "HollerTool"
    # a preference naming a distribution that does not offer the name does not silently pick one
    with pytest.raises(PluginError, match="offered by several distributions"):
        PluginRegistry({"tools": {"calculator": "nobody"}}).load("tools", "calculator")


def test_tools_call_takes_prefer_for_a_duplicate_name(dist_path):
    ambiguous = agentrl(dist_path, "tools", "call", "calculator", "--arguments", '{"expression": "3*4"}')
    assert ambiguous.returncode == 1 and "plugins.prefer.tools.calculator" in json.loads(ambiguous.stdout)["error"]
    builtin = agentrl(dist_path, "tools", "call", "calculator", "--prefer", "agentrl", "--arguments", '{"expression": "3*4"}')
    assert json.loads(builtin.stdout)["text"] == "12"
    theirs = agentrl(dist_path, "tools", "call", "calculator", "--prefer", "myplugin", "--arguments", '{"text": "a"}')
    assert json.loads(theirs.stdout) == {"text": "A", "reward": 0.25, "metrics": {"chars": 1.0}, "calc_reward": None}


def test_tools_call_reports_a_failing_tool_and_still_releases_it(dist_path, tmp_path):
    log = tmp_path / "lifecycle.txt"
    out = agentrl(
        dist_path, "tools", "call", "explode", "--arguments", "{}", "--create-kwargs", '{"seed": 1}',
        "--config", json.dumps({"log": str(log)}),
    )
    assert out.returncode == 1
    assert json.loads(out.stdout) == {"error": "explode failed: RuntimeError: boom"}
    assert "RuntimeError: boom" in out.stderr  # the traceback, for the plugin's author
    assert log.read_text().splitlines() == ["create [('seed', 1)]", "execute", "release"]


def make_row(**fields) -> Row:
    return Row.model_validate({"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], **fields})


def test_custom_loop_from_the_distribution_runs_a_rollout(dist_path, tiny_tokenizer):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import DataConfig, TrainConfig

    engine = ScriptedEngine(tiny_tokenizer, {"r": ["hello"]})
    setup = RolloutSetup.from_config(TrainConfig(data=DataConfig(max_response_length=64)))
    ctx = build_context(engine, tiny_tokenizer, setup, tool_names=["holler"])
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r", make_row(agent_name="one_shot"))]))
    assert (t.agent_name, t.reward, t.finish_reason) == ("one_shot", 0.75, "stop")
    assert t.messages[-1] == {"role": "assistant", "content": "hello"}


def test_plugin_tool_and_interaction_drive_the_builtin_tool_loop(dist_path, tiny_tokenizer):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import DataConfig, TrainConfig

    call = '<tool_call>\n{"name": "holler", "arguments": {"text": "hi"}}\n</tool_call>'
    engine = ScriptedEngine(tiny_tokenizer, {"r": [call, "done"]})
    setup = RolloutSetup.from_config(TrainConfig(data=DataConfig(max_response_length=256)))
    ctx = build_context(engine, tiny_tokenizer, setup, tool_names=["holler"])
    row = make_row(agent_name="tool_agent", extra_info={"tools_kwargs": {"holler": {}}, "interaction_kwargs": {"name": "always_right"}})
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r", row)]))
    assert t.finish_reason == "interaction_done"
    assert [(c.name, c.result, c.reward) for c in t.tool_calls] == [("holler", "HI", 0.25)]
    assert [(turn.role, turn.reward) for turn in t.turns] == [("assistant", 0.25), ("tool", None), ("assistant", 1.0)]


def test_a_data_source_declared_by_the_distribution_is_scored_by_its_reward_unless_the_config_names_one(dist_path, tiny_tokenizer):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import DataConfig, RewardConfig, TrainConfig

    def rewards(reward: RewardConfig) -> dict[str, float]:
        engine = ScriptedEngine(tiny_tokenizer, {"loud": ["HELLO"], "quiet": ["hello"], "other": ["#### 3"]})
        setup = RolloutSetup.from_config(TrainConfig(data=DataConfig(max_response_length=64), reward=reward))
        ctx = build_context(engine, tiny_tokenizer, setup, tool_names=[])
        rows = [(name, make_row(agent_name="single_turn", data_source=source, reward_model={"ground_truth": "3"}))
                for name, source in (("loud", "myplugin/shouting"), ("quiet", "myplugin/shouting"), ("other", "openai/gsm8k"))]
        return {t.row_id: t.reward for t in asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows))}

    # the declared reward for its data source; reward.default (gsm8k) for the others
    assert rewards(RewardConfig()) == {"loud": 1.0, "quiet": 0.25, "other": 1.0}
    # reward.by_data_source wins over the declaration
    assert rewards(RewardConfig(by_data_source={"myplugin/shouting": "gsm8k"})) == {"loud": 0.0, "quiet": 0.0, "other": 1.0}


@pytest.mark.ray
def test_plugins_resolve_inside_a_ray_actor(dist_path):
    import ray

    ray.init(
        address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(dist_path), "OMP_NUM_THREADS": "1", PLUGIN_TABLE_ENV: plugin_table(dist_path)}},
    )
    try:

        @ray.remote(num_cpus=0.5)
        class Worker:
            """Knows nothing of myplugin: everything comes from the installed metadata."""

            def call(self):
                import asyncio

                from agentrl.errors import PluginError
                from agentrl.plugins import PluginRegistry, discover

                registry = PluginRegistry()
                tool = registry.load("tools", "holler")()
                text = asyncio.run(tool.execute("i", {"text": "ray"})).text
                interaction = registry.load("interactions", "always_right")()
                done = asyncio.run(interaction.generate_response("i", [])).done
                loop = registry.load("agent_loops", "one_shot").name
                try:
                    registry.load("rewards", "broken")
                    broken = None
                except PluginError as exc:
                    broken = str(exc)
                dists = sorted({s.distribution for s in discover("tools")})
                return text, done, loop, broken, dists

        text, done, loop, broken, dists = ray.get(Worker.remote().call.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert (text, done, loop) == ("RAY", True, "one_shot")
    assert "distribution myplugin) failed to load: ImportError" in broken
    assert dists == ["agentrl", "myplugin"]


@pytest.mark.parametrize("command", ["train", "sft", "rollout"])
def test_a_configured_plugin_that_fails_to_import_stops_the_command_before_any_data_or_model(site, tmp_path, command):
    """The issue's late error: a reward that fails to import was found only after the SFT phase."""
    runs = tmp_path / "runs"
    done = agentrl(site, command, "reward.default=broken", f"trainer.runs_root={runs}")
    assert done.returncode != 0
    assert ("reward.default: plugin 'broken' in group agentrl.rewards (entry point broken = "
            "myplugin_broken:compute_score, distribution myplugin) failed to load: ImportError: "
            "this plugin is broken on purpose") in done.stderr
    assert not runs.exists()  # refused while reading the config: no run directory, no data, no model


def test_a_row_naming_a_tool_that_fails_to_import_is_named_before_any_model_is_loaded(site, tmp_path):
    """Installed is not enough: each plugin a row names is imported while the data is checked."""
    from agentrl.data.io import write_rows

    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "HI"},
             "extra_info": {"tools_kwargs": tools}} for tools in ({"holler": {}}, {"telescope": {}}, {"telescope": {}})]
    data = write_rows(rows, tmp_path / "rows.parquet")
    expected = (f"file {data}, row 1, field extra_info.tools_kwargs.telescope: tool 'telescope' cannot be loaded: "
                "plugin 'telescope' in group agentrl.tools (entry point telescope = myplugin_broken:Telescope, "
                f"distribution myplugin) failed to load: ImportError: this plugin is broken on purpose (the same in row 2 of {data})")
    validate = agentrl(site, "data", "validate", str(data))
    assert validate.returncode == 1
    assert validate.stdout.splitlines()[0] == expected
    assert "row 0" not in validate.stdout and f"file {data}, row 2" not in validate.stdout  # listed once, with row 1
    rollout = agentrl(site, "rollout", f"data.train_files=[{data}]", f"trainer.runs_root={tmp_path / 'runs'}")
    assert rollout.returncode != 0
    assert expected in rollout.stderr
    assert list((tmp_path / "runs").rglob("*.jsonl")) == []  # stopped before the engine: no trajectory written


def test_plugins_list_has_a_header_row_and_with_check_a_check_column(dist_path, capsys):
    from agentrl.cli import main

    assert main(["plugins", "list", "--group", "interactions"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "GROUP                 NAME          TARGET                                       DISTRIBUTION",
        "agentrl.interactions  always_right  myplugin_mod:AlwaysRightInteraction          myplugin",
        "agentrl.interactions  gsm8k         agentrl_interactions.gsm8k:Gsm8kInteraction  agentrl",
    ]
    assert main(["plugins", "list", "--group", "rewards", "--check"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["GROUP", "NAME", "TARGET", "DISTRIBUTION", "CHECK"]
    assert [line.split()[1::3] for line in out.splitlines()[1:]] == [
        ["broken", "BROKEN"], ["exact_number", "ok"], ["gsm8k", "ok"], ["gsm8k_flexible", "ok"]]
    assert err.startswith("plugin 'broken' in group agentrl.rewards")

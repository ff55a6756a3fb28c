"""Third-party plugins through real distribution metadata: listed, resolved in other processes
(a Ray actor included), a broken one isolated, duplicate names resolved by configuration."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl.plugins as plugins
from agentrl.errors import PluginError
from agentrl.plugins import PluginRegistry

PLUGIN_SOURCE = '''
from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.agent.loop import AgentLoop
from agentrl.agent.tool import Tool, ToolResult


class ShoutTool(Tool):
    name = "shout"
    description = "Upper-cases text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def execute(self, instance_id, arguments, **kwargs):
        return ToolResult(text=arguments["text"].upper(), reward=0.25)


class AlwaysRightInteraction(Interaction):
    async def generate_response(self, instance_id, messages):
        return InteractionResponse(done=True, text="", reward=1.0)


class OneShotLoop(AgentLoop):
    name = "one_shot"

    async def play(self, episode):
        _, _, text = await episode.generate()
        episode.messages.append({"role": "assistant", "content": text})
        episode.own_score = 0.75
        return "stop"
'''

ENTRY_POINTS = """
[agentrl.tools]
shout = myplugin_mod:ShoutTool
calculator = myplugin_mod:ShoutTool

[agentrl.interactions]
always_right = myplugin_mod:AlwaysRightInteraction

[agentrl.agent_loops]
one_shot = myplugin_mod:OneShotLoop

[agentrl.rewards]
broken = myplugin_broken:compute_score
"""


def make_distribution(root: Path) -> Path:
    """A real (unpacked) distribution on a path of its own: module source + dist-info."""
    root.mkdir(parents=True)
    (root / "myplugin_mod.py").write_text(PLUGIN_SOURCE)
    (root / "myplugin_broken.py").write_text("raise ImportError('this plugin is broken on purpose')\n")
    info = root / "myplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    (info / "RECORD").write_text("")
    return root


@pytest.fixture
def dist_path(tmp_path, monkeypatch):
    root = make_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    plugins.refresh()
    yield root
    plugins.refresh()


def env_with(path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}


def test_plugins_list_json_shows_the_distribution(dist_path):
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "plugins", "list", "--json"],
        capture_output=True, text=True, check=True, env=env_with(dist_path),
    )
    rows = json.loads(out.stdout)
    assert all(set(row) == {"group", "name", "target", "distribution"} for row in rows)
    mine = {(r["group"], r["name"]) for r in rows if r["distribution"] == "myplugin"}
    assert mine == {
        ("agentrl.tools", "shout"), ("agentrl.tools", "calculator"), ("agentrl.interactions", "always_right"),
        ("agentrl.agent_loops", "one_shot"), ("agentrl.rewards", "broken"),
    }
    assert {"group": "agentrl.tools", "name": "calculator", "target": "agentrl_tools.calculator:CalculatorTool", "distribution": "agentrl"} in rows


def test_tool_interaction_and_loop_from_the_distribution_resolve(dist_path):
    registry = PluginRegistry()
    tool = registry.load("tools", "shout")()
    result = asyncio.run(tool.execute("i", {"text": "hi"}))
    assert (result.text, result.reward) == ("HI", 0.25)
    assert registry.load("interactions", "always_right").__name__ == "AlwaysRightInteraction"
    assert registry.load("agent_loops", "one_shot").name == "one_shot"


def test_broken_plugin_is_named_and_isolated(dist_path):
    registry = PluginRegistry()
    with pytest.raises(PluginError) as info:
        registry.load("rewards", "broken")
    message = str(info.value)
    assert "entry point broken = myplugin_broken:compute_score" in message
    assert "distribution myplugin" in message and "this plugin is broken on purpose" in message
    assert registry.load("rewards", "gsm8k").__name__ == "gsm8k_strict"  # the others still load
    assert registry.load("tools", "shout").name == "shout"


def test_duplicate_name_is_an_error_until_the_config_chooses(dist_path):
    with pytest.raises(PluginError, match=r"offered by several distributions \(agentrl, myplugin\); choose one with plugins.prefer.tools.calculator=<distribution>"):
        PluginRegistry().load("tools", "calculator")
    assert PluginRegistry({"tools": {"calculator": "agentrl"}}).load("tools", "calculator").__module__ == "agentrl_tools.calculator"
    assert PluginRegistry({"tools": {"calculator": "myplugin"}}).load("tools", "calculator").__name__ == "ShoutTool"


def test_custom_loop_from_the_distribution_runs_a_rollout(dist_path, tiny_tokenizer):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.config.schema import AgentConfig, RewardConfig, RolloutConfig
    from agentrl.data.row import Row

    row = Row.model_validate({"data_source": "x", "prompt": [{"role": "user", "content": "hi"}], "agent_name": "one_shot"})
    engine = ScriptedEngine(tiny_tokenizer, {"r": ["hello"]})
    ctx = build_context(engine, tiny_tokenizer, agent=AgentConfig(), rollout=RolloutConfig(), reward=RewardConfig(),
                        max_response_tokens=64, tool_names=["shout"])
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r", row)]))
    assert (t.agent_name, t.reward, t.finish_reason) == ("one_shot", 0.75, "stop")


@pytest.mark.ray
def test_plugins_resolve_inside_a_ray_actor(dist_path):
    import ray

    ray.init(
        num_cpus=1, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(dist_path), "OMP_NUM_THREADS": "1"}},
    )
    try:

        @ray.remote(num_cpus=0.5)
        class Worker:
            def call(self):
                import asyncio

                from agentrl.plugins import PluginRegistry, discover

                registry = PluginRegistry()
                tool = registry.load("tools", "shout")()
                text = asyncio.run(tool.execute("i", {"text": "ray"})).text
                loop = registry.load("agent_loops", "one_shot").name
                dists = sorted({s.distribution for s in discover("tools")})
                return text, loop, dists

        worker = Worker.remote()
        text, loop, dists = ray.get(worker.call.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert (text, loop) == ("RAY", "one_shot")
    assert dists == ["agentrl", "myplugin"]

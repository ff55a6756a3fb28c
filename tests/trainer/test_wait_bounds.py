"""Every wait has a bound (#47 item 4): the blocking calls of the code (``wait_scan.py``: waits on
threads, processes, queues, events, Ray and subprocesses, awaits of engines, tools, interactions
and environments) that carry no timeout where they are written are listed here with what bounds
them, naming the config key where there is one. A new wait without a bound fails the first test
by name: give it a timeout, or add it here with its bound. ``KNOWN_GAPS`` are the waits found
with no bound at all: each is a defect to fix, listed so that it is seen (and so that fixing one
moves it to ``BOUNDS``)."""

from __future__ import annotations

import re

import pytest

from agentrl.config.schema import TrainConfig
from wait_scan import unbounded_calls

TRAJECTORY = "agent.trajectory_timeout_s: AgentLoop._play runs play() under asyncio.wait_for"
CHILD = "the engine process's child waiting for its parent's next command; ends at EOF when the parent goes"

BOUNDS: dict[str, str] = {
    # engine calls
    "agentrl/agent/loop.py::sample_turn::engine.generate": TRAJECTORY + "; SGLang also engine.request_timeout_s",
    "agentrl/agent/loop.py::assistant_turn::self.generate": TRAJECTORY,
    "agent_loops/react.py::play::episode.generate": TRAJECTORY,
    "agent_loops/single_turn.py::play::episode.generate": TRAJECTORY,
    "agent_loops/openenv_env.py::_play_text::episode.generate": TRAJECTORY,
    "agentrl/engines/sglang.py::_send::server.client.generate": "engine.request_timeout_s (the httpx client's), engine.max_retries",
    "agentrl/engines/builtin.py::close::worker.join": "the engine thread ends at its next step after the closed flag",
    # PolicyEngines hands each call to one policy's engine: bounded where the call is made
    "agentrl/engines/policies.py::generate::engine.generate": TRAJECTORY + " (the loops' engine calls, through it)",
    "agentrl/engines/policies.py::update_weights::self.engine(policy).update_weights":
        "engine.sync_timeout_s: the actor's _bounded_sync around every weight update",
    "agentrl/engines/policies.py::weights_changed::self.engine(policy).weights_changed":
        "engine.sync_timeout_s: the actor's _bounded_sync around every weight update",
    "agentrl/engines/launch.py::stop::self.process.wait": "after SIGKILL to the server's process group",
    "agentrl/engines/process.py::close::self._process.wait": "after kill(), once engine.sync_timeout_s (at most 30 s) passed",
    "agentrl/engines/preforked.py::discard::child.wait": "after kill(), once 10 s passed since its socket closed",
    "agentrl/engines/process.py::_read::self._conn.recv": "the reader thread: EOF when the child exits; each call's waiter "
                                                         "is bounded by its caller (engine.sync_timeout_s, the trajectory's)",
    "agentrl/engines/_process_child.py::main::conn.recv": CHILD,
    "agentrl/engines/_process_child.py::_serve::conn.recv": CHILD,
    "agentrl/engines/_process_child.py::read::conn.recv": CHILD,
    "agentrl/engines/_process_child.py::_serve::inbox.get": CHILD,
    # weight syncs
    "agentrl/engines/_process_child.py::_update::engine.update_weights": "the parent waits engine.sync_timeout_s (EngineProcess._bounded)",
    "agentrl/engines/serve.py::update_weights_from_disk::self.engine.update_weights":
        "agentrl serve's handler: the trainer's request waits engine.sync_timeout_s (_bounded_sync)",
    "agentrl/engines/serve.py::update_weights_from_distributed::self.engine.update_weights":
        "agentrl serve's handler: the trainer's request waits engine.sync_timeout_s (_bounded_sync)",
    "agentrl/engines/sglang.py::generate::self._admitting.wait": "set in a finally when the weight update ends; its server "
                                                                "calls wait engine.sync_timeout_s (_bounded_sync)",
    # tool calls, interactions
    "agentrl/agent/tools_runtime.py::execute_all::self.execute": "agent.tool_timeout_s: ToolSession.execute (_with_timeout)",
    "agentrl/agent/tools_runtime.py::one::self.execute": "agent.tool_timeout_s: ToolSession.execute (_with_timeout)",
    "agentrl/agent/loop.py::ask_interaction::ep.interaction.respond": TRAJECTORY,
    "agentrl/agent/tools_runtime.py::respond::self.interaction.generate_response": TRAJECTORY + " (called from ask_interaction)",
    "agentrl/agent/roles.py::ask::self.interaction.respond":
        "agent.trajectory_timeout_s: RolesLoop._play runs play_roles() under asyncio.wait_for",
    "tools/python_sandbox.py::pump::proc.wait": "the tool's wall time: pump() runs under asyncio.wait_for",
    "tools/python_sandbox.py::_run::proc.wait": "after _kill_group: the sandbox's process group is killed first",
    "tools/_sandbox_boot.py::main::os.wait": "the sandbox's parent kills the process group at its wall time",
    # environment steps and sessions
    "agent_loops/openenv_env.py::run::state.session.open": "agent.trajectory_timeout_s for a free session (asyncio.wait_for), "
                                                         "environment.openenv.step_timeout_s for the reset",
    "agent_loops/openenv_env.py::_play_text::state.session.step": TRAJECTORY + "; each step environment.openenv.step_timeout_s",
    "agent_loops/openenv_env.py::_call::session.step": TRAJECTORY + "; each step environment.openenv.step_timeout_s",
    # Ray calls
    "agentrl/trainer/groups.py::_collect::ray.get": "refs ray.wait returned ready within trainer.collective_timeout_s",
    "agentrl/trainer/nodes.py::check_nodes_can_write::ray.get": "refs ray.wait returned ready within its timeout_s",
    "agentrl/trainer/groups.py::get::ray.get": "rank 0's calls (call_rank0): a rollout, every trajectory under "
                                              "agent.trajectory_timeout_s; finished_rollouts under its wait_s "
                                              "(rollout.max_wait_s overall); the engine's version and the health probe, one request",
}

# waits with no bound found (each a defect: the wait can last forever)
KNOWN_GAPS: dict[str, str] = {
    "agentrl/agent/tools_cli.py::call_tool::tool.create": "agentrl tool call (by hand): no timeout",
    "agentrl/agent/tools_cli.py::call_tool::tool.execute": "agentrl tool call (by hand): no timeout",
    "agentrl/agent/tools_cli.py::call_tool::tool.calc_reward": "agentrl tool call (by hand): no timeout",
    "agentrl/agent/tools_cli.py::call_tool::tool.release": "agentrl tool call (by hand): no timeout",
}


def test_every_wait_without_a_timeout_of_its_own_is_listed_with_its_bound():
    found = unbounded_calls()
    unlisted = {k: line for k, line in found.items() if k not in BOUNDS and k not in KNOWN_GAPS}
    assert not unlisted, f"waits with no bound in place and none listed here (give each a timeout, or its bound): {unlisted}"
    gone = sorted(set(BOUNDS) - set(found))
    assert not gone, f"entries whose call is no longer found (moved, renamed or bounded in place): remove them: {gone}"
    fixed = sorted(set(KNOWN_GAPS) - set(found))
    assert not fixed, f"known gaps no longer found unbounded: remove them from KNOWN_GAPS: {fixed}"


def test_the_config_keys_the_bounds_name_exist():
    keys = set()

    def walk(model, prefix=""):
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                walk(value, f"{prefix}{name}.")
            else:
                keys.add(f"{prefix}{name}")

    walk(TrainConfig())
    named = {m for text in [*BOUNDS.values(), *KNOWN_GAPS.values()]
             for m in re.findall(r"\b(?:agent|engine|rollout|trainer|environment)\.[a-z_.]+[a-z_]", text)}
    assert named and not named - keys, sorted(named - keys)


def test_the_scan_finds_a_wait_without_a_timeout_and_passes_one_with_it(tmp_path, monkeypatch):
    import wait_scan

    (tmp_path / "agentrl").mkdir()
    (tmp_path / "agentrl" / "m.py").write_text(
        "import ray, subprocess, asyncio\n"
        "def a(refs, q, t):\n    ray.get(refs)\n    q.get()\n    t.join()\n    subprocess.run(['x'])\n"
        "def b(refs, q, t, e):\n    ray.get(refs, timeout=5)\n    q.get(timeout=1)\n    t.join(timeout=1)\n    e.wait(3)\n"
        "    ', '.join(['x'])\n    {}.get('k')\n"
        "async def c(engine, r):\n    await engine.generate(r)\n    await asyncio.wait_for(engine.generate(r), 5)\n")
    monkeypatch.setattr(wait_scan, "REPO", tmp_path)
    assert set(wait_scan.unbounded_calls()) == {"agentrl/m.py::a::ray.get", "agentrl/m.py::a::q.get", "agentrl/m.py::a::t.join",
                                                "agentrl/m.py::a::subprocess.run", "agentrl/m.py::c::engine.generate"}


def test_a_tool_whose_create_or_calc_reward_hangs_is_cut_at_the_tool_timeout():
    import asyncio

    from agentrl.agent.tool import Tool
    from agentrl.agent.tools_runtime import ToolBox

    class Hangs(Tool):
        name, description, parameters = "hangs", "never answers", {"type": "object", "properties": {}}

        def __init__(self, where: str):
            self.where = where

        async def create(self, instance_id, **kwargs):
            if self.where == "create":
                await asyncio.sleep(60)

        async def calc_reward(self, instance_id, **kwargs):
            await asyncio.sleep(60)

    async def enter(where: str):
        session = ToolBox({"hangs": Hangs(where)}, tool_timeout_s=0.05).session("t#0", {})
        async with session:
            await session.collect_rewards()
            return session.calc_reward_errors

    with pytest.raises(TimeoutError, match=r"^tool 'hangs': create did not finish within agent.tool_timeout_s=0.05 s$"):
        asyncio.run(enter("create"))
    assert asyncio.run(enter("calc_reward")) == {
        "hangs": "TimeoutError: tool 'hangs': calc_reward did not finish within agent.tool_timeout_s=0.05 s"}

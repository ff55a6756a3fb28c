"""OpenEnv environments (openenv 0.10) driven by the ``openenv_env`` loop through OpenEnv's own
client, each served by OpenEnv's own server code in a process agentrl starts. The environments
(openenv_fixture.py) are written against OpenEnv's public API as a third party would: an
``Environment`` subclass with typed ``Action`` / ``Observation`` models served from the app
``create_app`` builds, one named as its class, and an ``MCPEnvironment`` with FastMCP tools. With
the scripted engine: the exact token stream of a tool episode and of a text episode, step rewards
on the turns that made the actions, MCP tools offered and called, a server given by URL; the
failures (environment code raising, a server killed mid-episode and restarted by the next
trajectory, a step that times out, a server that does not answer) ending their trajectories
``environment_error`` with the kind counted; a name that cannot be served refused before a server
starts; the server ending itself with its parent. The ``agentrl train`` run is in
test_openenv_train.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from openenv_fixture import GuessAction, GuessObservation, ReplyAction

from agentrl.agent.runner import build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import DataConfig, EnvironmentConfig, TrainConfig
from agentrl.data.row import Row
from agentrl.environments import spec
from agentrl.environments.openenv import action_spec, mcp_result, observation_text, server_for, stop_all_servers
from agentrl.errors import PluginError


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def servers():
    yield
    stop_all_servers()
    spec.clear_cache()


def ctx_for(tokenizer, script, name: str, args: dict | None = None, **openenv):
    env = EnvironmentConfig(library="openenv", name=f"openenv_fixture:{name}", args=args or {},
                            openenv={"max_sessions": 4, "step_timeout_s": 5.0, **openenv})
    cfg = TrainConfig(environment=env, data=DataConfig(max_response_length=512))
    engine = ScriptedEngine(tokenizer, script)
    return build_context(engine, tokenizer, RolloutSetup.from_config(cfg), tool_names=[]), engine


def row(name: str, **args) -> Row:
    extra = {"index": 0, "environment": {"library": "openenv", "name": f"openenv_fixture:{name}", "args": args}}
    return Row.model_validate({"data_source": "openenv/test", "prompt": [{"role": "user", "content": "Play."}],
                               "extra_info": extra})


def run(ctx, rows):
    from agentrl_agent_loops.openenv_env import OpenEnvLoop

    loop = OpenEnvLoop()

    async def go():
        return [await loop.run(r, ctx, row_id=rid, group_id=f"g:{rid}") for rid, r in rows]

    return asyncio.run(go())


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def call(guess) -> str:
    return '<tool_call>\n{"name": "guess", "arguments": {"guess": ' + json.dumps(guess) + '}}\n</tool_call>'


GUESS_TOOL = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number.",
    "parameters": {"type": "object", "properties": {"guess": {"description": "your guess, 0 to 9", "title": "Guess",
                                                              "type": "integer"}}, "required": ["guess"]}}}


# ----------------------------------------------------------------------------- mapping
def test_an_action_with_one_string_field_takes_text_and_any_other_is_a_tool_of_its_fields():
    assert action_spec(ReplyAction.model_json_schema()).mode == "text"
    assert action_spec(ReplyAction.model_json_schema()).text_field == "message"
    spec_ = action_spec(GuessAction.model_json_schema())
    assert spec_.mode == "tool" and spec_.tools() == [GUESS_TOOL]
    assert action_spec(ReplyAction.model_json_schema(), "tool").tool["function"]["name"] == "reply"
    observation = GuessObservation(feedback="hi", reward=1.0, metadata={"x": 1}).model_dump(exclude={"reward", "done"})
    assert observation_text(observation) == "hi"
    assert observation_text({"a": 1, "b": "x", "metadata": {}}) == '{"a": 1, "b": "x"}'
    assert observation_text({"a": 1, "b": "x"}, "a") == "1"
    assert observation_text({"metadata": {"task": "x"}, "reward": 0.0, "done": False}) == ""
    from openenv.core.env_server.mcp_types import CallToolAction

    assert action_spec(CallToolAction.model_json_schema()).mode == "mcp"
    assert action_spec(CallToolAction.model_json_schema(), "tool").tool_name == "call_tool"
    assert mcp_result({"tool_name": "f", "result": None, "error": {"error_type": "execution_error", "message": "boom"}}) == (
        "Error: boom", "execution_error")
    assert mcp_result({"result": {"content": [], "data": {"x": 1}}, "error": None}) == ('{"x": 1}', None)


def test_a_tool_episode_is_exact_tokens_with_step_rewards_on_the_turns_that_acted(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx, engine = ctx_for(tok, {"r0": [call(3), call(5)]}, "guess_app")
    [t] = run(ctx, [("r0", row("guess_app", secret=5))])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    c1, c2 = enc(tok, call(3)) + [eos], enc(tok, call(5)) + [eos]
    obs = enc(tok, "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    sep = enc(tok, "\n")
    # the reset observation follows the row's prompt as a user message; the action is the tool
    messages = [{"role": "user", "content": "Play."}, {"role": "user", "content": "Guess my number (0-9)."}]
    assert t.prompt_ids == ctx.renderer.prompt_ids(messages, [GUESS_TOOL])
    assert t.response_ids == c1 + obs + c2 + sep
    assert t.response_mask == [1] * len(c1) + [0] * len(obs) + [1] * len(c2) + [0]
    assert t.logprobs == [-0.5] * len(c1) + [0.0] * len(obs) + [-0.5] * len(c2) + [0.0]
    a, b = len(c1), len(c1) + len(obs)
    assert [(x.role, x.start, x.end, x.reward) for x in t.turns] == [
        ("assistant", 0, a, -0.25), ("tool", a, b, None), ("assistant", b, b + len(c2), 1.0)]
    assert engine.requests[1].input_ids == t.prompt_ids + c1 + obs
    assert t.finish_reason == "stop" and t.reward == 0.0 and t.agent_name == "openenv_env"
    assert t.metrics["env/return"] == 0.75 and t.metrics["env/steps"] == 2 and t.metrics["env/done"] == 1
    assert [(c.name, c.arguments, c.result, c.reward) for c in t.tool_calls] == [
        ("guess", {"guess": 3}, "higher", -0.25), ("guess", {"guess": 5}, "correct", 1.0)]


def test_a_text_episode_sends_the_reply_and_shows_the_observation_as_a_user_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    ctx, _ = ctx_for(tok, {"r0": ["beetle", "her"]}, "ReplyEnvironment")
    [t] = run(ctx, [("r0", row("ReplyEnvironment", letter="e"))])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    a1, a2 = enc(tok, "beetle") + [eos], enc(tok, "her") + [eos]
    obs = enc(tok, "\n<|im_start|>user\nMore words with e.<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "Play."}, {"role": "user", "content": "Say words with the letter e."}]
    assert t.prompt_ids == ctx.renderer.prompt_ids(messages, None)
    assert t.response_ids == a1 + obs + a2 + enc(tok, "\n")
    assert t.response_mask == [1] * len(a1) + [0] * len(obs) + [1] * len(a2) + [0]
    assert [(x.role, x.reward) for x in t.turns] == [("assistant", 0.75), ("user", None), ("assistant", 0.25)]
    assert t.finish_reason == "stop" and t.reward == 0.0 and t.metrics["env/return"] == 1.0


def test_reward_trajectory_makes_the_return_the_trajectory_reward(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": ["banana", "apple"]}, "ReplyEnvironment", reward="trajectory")
    [t] = run(ctx, [("r0", row("ReplyEnvironment", letter="a"))])
    assert t.reward == 1.0 and [x.reward for x in t.turns] == [None, None, None]


def test_a_row_without_an_environment_plays_the_configs_with_its_args(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(3), call(2)]}, "guess_app", args={"secret": 2})
    plain = Row.model_validate({"data_source": "openenv/test", "prompt": [{"role": "user", "content": "Play."}],
                                "extra_info": {"index": 0}})
    [t] = run(ctx, [("r0", plain)])
    assert [(c.arguments, c.result, c.reward) for c in t.tool_calls] == [({"guess": 3}, "lower", -0.25), ({"guess": 2}, "correct", 1.0)]
    assert t.finish_reason == "stop" and t.metrics["env/return"] == 0.75


def test_a_row_that_names_no_environment_plays_the_configs_with_the_rows_args(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(9), call(2)]}, "guess_app", args={"secret": 9})
    nameless = Row.model_validate({"data_source": "openenv/test", "prompt": [{"role": "user", "content": "Play."}],
                                   "extra_info": {"index": 0, "environment": {"library": "openenv", "args": {"secret": 2}}}})
    [t] = run(ctx, [("r0", nameless)])
    assert [(c.arguments, c.result) for c in t.tool_calls] == [({"guess": 9}, "lower"), ({"guess": 2}, "correct")]
    assert server_for(ctx.environment_ref(nameless), ctx.environment.openenv).name == "openenv_fixture:guess_app"


def test_bad_arguments_are_told_to_the_model_and_do_not_step(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call("x"), call(7)]}, "guess_app")
    [t] = run(ctx, [("r0", row("guess_app", secret=7))])
    assert t.tool_calls[0].error == "invalid_arguments" and t.tool_calls[0].result.startswith("Error: invalid arguments for guess")
    assert t.metrics["tool_errors/invalid_arguments"] == 1 and t.metrics["env/steps"] == 1
    assert t.finish_reason == "stop" and [x.reward for x in t.turns if x.role == "assistant"] == [None, 1.0]


def test_a_malformed_call_is_penalized_on_its_turn_or_ends_the_episode_as_the_policy_says(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call("x"), call(7)], "r1": [call("x"), call(7)]}, "guess_app")
    ctx.limits = dataclasses.replace(ctx.limits, malformed_call_policy="penalize", malformed_call_penalty=-0.5)
    [t] = run(ctx, [("r0", row("guess_app", secret=7))])
    assert t.finish_reason == "stop" and [x.reward for x in t.turns if x.role == "assistant"] == [-0.5, 1.0]
    ctx.limits = dataclasses.replace(ctx.limits, malformed_call_policy="end")
    [t] = run(ctx, [("r1", row("guess_app", secret=7))])
    assert t.finish_reason == "malformed_tool_call" and [x.role for x in t.turns] == ["assistant"]
    assert t.metrics["tool_errors/invalid_arguments"] == 1 and t.metrics["env/steps"] == 0 and "error" not in t.reward_info


def test_an_exception_in_the_environment_code_ends_the_trajectory_environment_error(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(3), call(13)], "r1": [call(7)]}, "guess_app")
    bad, good = run(ctx, [("r0", row("guess_app", secret=7)), ("r1", row("guess_app", secret=7))])
    assert bad.finish_reason == "environment_error" and bad.metrics["env_errors/env_exception"] == 1
    assert "13 is unlucky" in bad.reward_info["error"] and "step on the OpenEnv server" in bad.reward_info["error"]
    # the server lives on: the next trajectory plays without a restart
    assert good.finish_reason == "stop" and "env_errors/server_restarts" not in good.metrics


def test_a_server_given_by_url_is_used_as_it_is_and_one_that_does_not_answer_fails_at_start(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(5)]}, "guess_app")
    own = server_for(ctx.environment_ref(row("guess_app")), ctx.environment.openenv)
    run(ctx, [("r0", row("guess_app", secret=5))])  # agentrl's server of guess_app is up
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(5)]}, "guess_app", url=own.url)
    nameless = Row.model_validate({"data_source": "openenv/test", "prompt": [{"role": "user", "content": "Play."}],
                                   "extra_info": {"index": 0, "environment": {"library": "openenv", "args": {"secret": 5}}}})
    [t] = run(ctx, [("r0", nameless)])  # with a URL the row need not name what the server serves
    assert t.finish_reason == "stop" and t.metrics["env/return"] == 1.0
    theirs = server_for(ctx.environment_ref(nameless), ctx.environment.openenv)
    assert theirs is not own and theirs.url == own.url and theirs.process is None and theirs.generation == 0
    assert theirs.name == own.url
    gone = f"http://127.0.0.1:{_closed_port()}"
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(5)]}, "guess_app", url=gone)
    [t] = run(ctx, [("r0", row("guess_app", secret=5))])
    assert t.finish_reason == "environment_error" and t.metrics["env_errors/server_start"] == 1
    assert f"GET {gone}/schema: ConnectError" in t.reward_info["error"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_killed_mid_episode_fails_its_trajectory_and_the_next_one_restarts_it(tiny_tokenizer):
    server = {}

    def script(row_id, index, request):
        if row_id == "r0" and index == 1:
            server["pid"] = server["s"].process.pid
            server["s"].process.kill()
            server["s"].process.wait()
        return "apple"

    ctx, _ = ctx_for(tiny_tokenizer, script, "ReplyEnvironment")
    server["s"] = server_for(ctx.environment_ref(row("ReplyEnvironment", letter="a")), ctx.environment.openenv)
    dead, after = run(ctx, [("r0", row("ReplyEnvironment", letter="a")), ("r1", row("ReplyEnvironment", letter="a"))])
    assert dead.finish_reason == "environment_error" and dead.metrics["env_errors/server_lost"] == 1
    assert "lost the OpenEnv server" in dead.reward_info["error"] and "during step" in dead.reward_info["error"]
    assert after.finish_reason == "stop" and after.metrics["env_errors/server_restarts"] == 1
    assert server["s"].process.pid != server["pid"] and server["s"].generation >= 2


def test_a_step_that_outlives_step_timeout_s_is_an_environment_error_naming_the_wait(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": [call(11)]}, "guess_app")
    [t] = run(ctx, [("r0", row("guess_app", secret=7))])
    assert t.finish_reason == "environment_error" and t.metrics["env_errors/timeout"] == 1
    assert "waited environment.openenv.step_timeout_s=5 s for step" in t.reward_info["error"]


def test_a_name_that_is_not_an_openenv_app_or_environment_is_refused_before_a_server_starts(tiny_tokenizer):
    ctx, _ = ctx_for(tiny_tokenizer, {"r0": ["hi"]}, "NOT_AN_APP")
    with pytest.raises(PluginError, match="'openenv_fixture:NOT_AN_APP' is a str: name a FastAPI app built with openenv's create_app"):
        run(ctx, [("r0", row("NOT_AN_APP"))])


def test_the_server_process_ends_itself_when_its_parent_is_gone(tmp_path):
    """A worker killed without cleanup leaves no server: the server watches its parent's pid (here a
    pid that is not its parent's, as after the parent died), before it imports anything heavy."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    started = subprocess.Popen([sys.executable, "-m", "agentrl.environments.openenv_serve", "openenv_fixture:guess_app",
                                "--port", str(_closed_port()), "--parent-pid", "1"], env=env, cwd=tmp_path)
    try:
        assert started.wait(timeout=60) == 0
    finally:
        started.kill()


def test_an_mcp_environment_offers_its_mcp_tools_and_each_call_is_a_call_tool_step(tiny_tokenizer):
    tok = tiny_tokenizer

    def mcp_call(name, **arguments):
        return '<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}) + '\n</tool_call>'

    script = {"r0": [mcp_call("add", a=1, b=1), mcp_call("mul", a=2), mcp_call("add", a=4, b=5)]}
    ctx, _ = ctx_for(tok, script, "calc_app")
    [t] = run(ctx, [("r0", row("calc_app", a=4, b=5))])
    add = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "additionalProperties": False, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "type": "object"}}}
    # the reset observation has no fields: the prompt is the row's, with the environment's tools
    assert t.prompt_ids == ctx.renderer.prompt_ids([{"role": "user", "content": "Play."}], [add])
    assert [(c.name, c.result, c.error, c.reward) for c in t.tool_calls] == [
        ("add", "2", None, 0.0), ("mul", "Error: unknown tool 'mul' (available: add)", "unknown_tool", None),
        ("add", "9", None, 1.0)]
    assert [x.reward for x in t.turns if x.role == "assistant"] == [0.0, None, 1.0]
    assert t.finish_reason == "stop" and t.metrics["env/steps"] == 2 and t.metrics["env/done"] == 1
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["2", "Error: unknown tool 'mul' (available: add)"]



def test_openenv_imports_without_gradio_until_its_web_interface_is_asked_for():
    """The server and the worker import openenv without its Gradio web interface (most of a server's
    start); an app that asks for the interface, from the package or the module, still gets it; with
    ENABLE_WEB_INTERFACE set openenv is left to import as it does."""
    import os
    import subprocess
    import sys

    code = """if True:
        import os, sys
        import importlib.util
        import agentrl.environments  # installs the import hook
        from agentrl.environments.openenv_serve import defer_openenv_web_ui
        os.environ["ENABLE_WEB_INTERFACE"] = "true"
        print(type(importlib.util.find_spec("openenv.core").loader).__name__)  # openenv's own loader
        del os.environ["ENABLE_WEB_INTERFACE"]
        defer_openenv_web_ui()  # the hook left with that find: again
        from openenv_fixture import guess_app
        from openenv.core import GenericEnvClient
        print("gradio" in sys.modules, type(guess_app).__name__)
        from openenv.core.env_server import create_web_interface_app
        import openenv.core
        print("gradio" in sys.modules, create_web_interface_app.__module__, openenv.core.WebInterfaceManager.__module__)
        from openenv.core.env_server.web_interface import create_web_interface_app as again
        print(again is create_web_interface_app)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    web = "openenv.core.env_server.web_interface"
    assert out.stdout.splitlines() == ["SourceFileLoader", "False FastAPI", f"True {web} {web}", "True"]

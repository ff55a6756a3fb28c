"""The typed rollout seam: the setup is built from the config alone, every turn limit is checked
in one place that custom loops share, each loop gets its configured parser, and finish reasons
are one enum."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import pickle
from pathlib import Path

import pytest
from agent_helpers import CALL_12x34, make_row

import agentrl
from agentrl.agent.loop import AgentLoop, Episode, EpisodeEnd
from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import Limits, RolloutSetup
from agentrl.agent.tool_parsers import HermesToolParser, ReactToolParser
from agentrl.config import load_config
from agentrl.config.schema import TrainConfig
from agentrl.engines.base import SamplingParams
from agentrl.errors import ConfigError, TrajectoryError
from agentrl.trajectory import Trajectory, TrajectoryFinish

REPO = Path(agentrl.__file__).resolve().parents[1]


class Persistent(AgentLoop):
    """A plugin loop that never looks at a limit: it runs every call the model makes and, after
    an answer, asks the model to go on. Only the episode can stop it."""

    name = "persistent"

    def prompt_tools(self, tool_schemas):
        return tool_schemas or None

    async def play(self, episode: Episode) -> TrajectoryFinish:
        while True:
            _, _, text = await episode.generate()
            parsed = episode.parser.parse(text)
            episode.messages.append({"role": "assistant", "content": parsed.content})
            if parsed.calls:
                outcomes = await episode.call_tools(len(episode.builder.turns) - 1, parsed)
                episode.observe([{"role": "tool", "content": o.text} for o in outcomes], "tool")
            else:
                episode.observe([{"role": "user", "content": "Go on."}], "user")


def run_loop(loop: AgentLoop, ctx, row, row_id: str = "r0"):
    return asyncio.run(loop.run(row, ctx, row_id=row_id, group_id="g"))


# ----------------------------------------------------------------------------- the setup


def test_the_setup_carries_each_command_line_value_to_limits_sampling_tools_and_engine():
    cfg = load_config("train", [
        "agent.max_assistant_turns=3", "agent.max_user_turns=2", "data.max_response_length=300", "rollout.max_new_tokens=40",
        "agent.max_tool_response_tokens=17", "agent.trajectory_timeout_s=9.5", "agent.malformed_call_policy=end",
        "agent.malformed_call_penalty=-0.5", "agent.program_error_reward=-0.25", "rollout.temperature=0.7", "rollout.val_temperature=0.1", "rollout.top_p=0.9",
        "rollout.top_k=5", "rollout.max_concurrency=7", "engine.max_batch_size=3", "engine.decode_graphs=true", "trainer.seed=11", "engine.weight_sync=disk",
        "agent.default_loop=react", "agent.tool_parser=react", "agent.max_parallel_calls=2", "agent.tool_timeout_s=4",
        "plugins.prefer.tools.calculator=agentrl",
    ])  # fmt: skip
    setup = RolloutSetup.from_config(cfg, weights_dir="/w")
    assert setup.limits == Limits(
        max_assistant_turns=3, max_user_turns=2, max_response_tokens=300, max_new_tokens=40, max_tool_response_tokens=17,
        trajectory_timeout_s=9.5, malformed_call_policy="end", malformed_call_penalty=-0.5, program_error_reward=-0.25,
    )  # fmt: skip
    assert setup.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
    assert setup.val_sampling == SamplingParams(temperature=0.1, top_p=0.9, top_k=5)
    assert (setup.default_loop, setup.tool_parser, setup.tool_parser_by_loop) == ("react", "react", {"react": "react"})
    assert (setup.tool_names, setup.max_parallel_calls, setup.tool_timeout_s) == ((), 2, 4.0)  # no tool configured: none by default
    assert setup.plugin_prefer == {"tools": {"calculator": "agentrl"}}
    assert (setup.max_concurrency, setup.engine_max_batch_size, setup.seed) == (7, 3, 11)
    assert setup.engine_decode_graphs is True
    assert (setup.weight_sync, setup.weights_dir) == ("disk", "/w")


def test_limits_and_setup_have_no_defaults_of_their_own():
    # the schema is the one place defaults live: a field defaulted here could disagree with it
    for cls in (Limits, RolloutSetup):
        defaulted = [f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
                     or f.default_factory is not dataclasses.MISSING]  # fmt: skip
        assert defaulted == [], cls.__name__
    with pytest.raises(TypeError):
        Limits()  # type: ignore[call-arg]


def test_the_setup_is_frozen_and_crosses_a_process_boundary_intact():
    setup = RolloutSetup.from_config(TrainConfig(), weights_dir="/w")
    assert pickle.loads(pickle.dumps(setup)) == setup  # how Ray ships it to the actor
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.seed = 1  # type: ignore[misc]


def test_validation_contexts_sample_at_the_validation_temperature(tiny_tokenizer):
    setup = RolloutSetup.from_config(TrainConfig())
    train = build_context(None, tiny_tokenizer, setup)  # type: ignore[arg-type]
    val = build_context(None, tiny_tokenizer, setup, validation=True)  # type: ignore[arg-type]
    assert (train.sampling.temperature, val.sampling.temperature) == (1.0, 0.0)
    assert train.limits is setup.limits


# ----------------------------------------------------------------------------- one check of every limit


def test_a_command_line_turn_limit_stops_a_custom_loop_that_never_checks_it(tiny_tokenizer):
    cfg = load_config("train", ["agent.max_assistant_turns=3"])
    engine = ScriptedEngine(tiny_tokenizer, lambda *a: CALL_12x34)
    ctx = build_context(engine, tiny_tokenizer, RolloutSetup.from_config(cfg))
    t = run_loop(Persistent(), ctx, make_row())
    assert t.finish_reason is TrajectoryFinish.MAX_ASSISTANT_TURNS
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    # the third turn's call is not executed: no turn is left to read its result
    assert (t.metrics["turns"], t.metrics["tool_calls"], t.metrics["tool_calls_unexecuted"]) == (3.0, 2.0, 1.0)
    assert len(engine.requests) == 3


def test_the_user_turn_limit_stops_a_custom_loop_that_never_checks_it(make_ctx, tiny_tokenizer):
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, lambda *a: "#### 1"), agent={"max_user_turns": 2})
    t = run_loop(Persistent(), ctx, make_row())
    assert t.finish_reason is TrajectoryFinish.MAX_USER_TURNS
    assert [x.role for x in t.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    assert (t.metrics["turns"], t.metrics["user_turns"]) == (3.0, 2.0)


def test_the_response_budget_stops_a_custom_loop_that_never_checks_it(make_ctx, tiny_tokenizer):
    # the call is 25 tokens and its result 16: the second observation would reach 25+16+25+16 > 70
    engine = ScriptedEngine(tiny_tokenizer, lambda *a: CALL_12x34)
    ctx = make_ctx(engine, limits={"max_response_tokens": 70})
    t = run_loop(Persistent(), ctx, make_row())
    assert t.finish_reason is TrajectoryFinish.RESPONSE_BUDGET
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant"]
    assert [r.sampling.max_new_tokens for r in engine.requests] == [70, 70 - 41]


def test_turn_limits_are_read_only_by_the_episodes_one_check():
    """Each turn limit is read once, in ``Episode.check_turn`` (``tokens_left`` for the budget),
    besides copying it from the config: no loop checks a limit of its own."""
    limits = {"max_assistant_turns", "max_user_turns", "max_response_tokens"}
    reads: set[tuple[str, str]] = set()
    for top in ("agentrl", "agent_loops", "interactions", "tools"):
        for path in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(fn):
                        if isinstance(node, ast.Attribute) and node.attr in limits and isinstance(node.ctx, ast.Load):
                            reads.add((str(path.relative_to(REPO)), fn.name))
    assert reads == {
        ("agentrl/agent/setup.py", "from_config"),  # Limits.from_config: AgentConfig -> Limits
        ("agentrl/agent/loop.py", "check_turn"),
        ("agentrl/agent/loop.py", "tokens_left"),
        # the OpenAI endpoint's sessions are episodes of programs that are no loops: their one check
        ("agentrl/agent/openai_endpoint.py", "check_turn"),
        ("agentrl/agent/openai_endpoint.py", "tokens_left"),
        # /tokenize reports the budget as vLLM's max_model_len field (verifiers' token client reads it); it checks nothing
        ("agentrl/agent/openai_endpoint.py", "tokenize"),
    }


# ----------------------------------------------------------------------------- the configured parser

REACT_HERMES = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n',
    "#### 408",
]


def run_react(tokenizer, make_ctx, agent):
    ctx = make_ctx(ScriptedEngine(tokenizer, {"r0": REACT_HERMES}), agent=agent)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("react")).run([("r0", make_row(agent="react"))]))
    return t, ctx


def test_react_uses_the_react_parser_by_default_and_tool_agent_hermes(make_ctx, tiny_tokenizer):
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, {}))
    assert isinstance(ctx.parser_for("react"), ReactToolParser)
    assert isinstance(ctx.parser_for("tool_agent"), HermesToolParser)
    # with the default parser a hermes call is only a line of thought to react
    t, _ = run_react(tiny_tokenizer, make_ctx, {})
    assert t.tool_calls == [] and t.finish_reason == "stop"


def test_react_runs_the_calls_of_the_configured_parser(make_ctx, tiny_tokenizer):
    # verl's loop name is accepted as the key
    t, ctx = run_react(tiny_tokenizer, make_ctx, {"tool_parser_by_loop": {"react_agent": "hermes"}})
    assert isinstance(ctx.parser_for("react"), HermesToolParser)
    assert [(c.name, c.arguments, c.result) for c in t.tool_calls] == [("calculator", {"expression": "12 * 34"}, "408")]
    assert tiny_tokenizer.decode(t.response_ids) == REACT_HERMES[0] + "Observation: 408\n#### 408<|im_end|>\n"
    assert (t.finish_reason, t.reward) == ("stop", 1.0)


def test_a_loop_parser_is_set_from_the_command_line_and_unknown_names_are_refused():
    cfg = load_config("train", ["agent.tool_parser_by_loop.react=hermes"])
    assert RolloutSetup.from_config(cfg).tool_parser_by_loop == {"react": "hermes"}
    with pytest.raises(ConfigError) as err:
        load_config("train", ["agent.tool_parser_by_loop.react=hermez", "agent.tool_parser_by_loop.reakt=react"])
    keys = [key for key, _ in err.value.problems]
    assert keys == ["agent.tool_parser_by_loop.reakt", "agent.tool_parser_by_loop.react"]
    assert "no plugin named 'hermez' in group agentrl.tool_parsers" in str(err.value)
    assert "no plugin named 'reakt' in group agentrl.agent_loops" in str(err.value)


# ----------------------------------------------------------------------------- finish reasons


def trajectory(finish_reason) -> Trajectory:
    return Trajectory(
        row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="a", prompt_ids=[1], response_ids=[],
        response_mask=[], logprobs=[], turns=[], messages=[], finish_reason=finish_reason,
    )  # fmt: skip


def test_a_trajectory_with_an_unknown_finish_reason_is_refused_naming_the_field():
    with pytest.raises(TrajectoryError, match=r"trajectory r: finish_reason: unknown finish reason 'timeout' \(known: stop, length, "):
        trajectory("timeout")  # the name the docs once gave trajectory_timeout
    assert trajectory("trajectory_timeout").finish_reason is TrajectoryFinish.TRAJECTORY_TIMEOUT


def test_a_finish_reason_reads_as_its_value_in_metric_names_json_and_comparisons():
    import json

    reason = TrajectoryFinish.MAX_ASSISTANT_TURNS
    assert (f"finish/{reason}", str(reason), json.dumps({reason: reason})) == (
        "finish/max_assistant_turns", "max_assistant_turns", '{"max_assistant_turns": "max_assistant_turns"}'
    )
    assert reason == "max_assistant_turns" and {"max_assistant_turns": 1}[reason] == 1


def test_every_finish_reason_is_documented_in_the_enum_docstring():
    doc = TrajectoryFinish.__doc__ or ""
    assert [r.value for r in TrajectoryFinish if f"``{r.value}``" not in doc] == []


class Misnamed(AgentLoop):
    name = "misnamed"

    async def play(self, episode: Episode) -> TrajectoryFinish:
        await episode.generate()
        return "timeout"  # type: ignore[return-value]


def test_a_loop_that_returns_an_unknown_finish_reason_is_a_loop_error(make_ctx, tiny_tokenizer):
    loops = LoopTable("tool_agent")
    loops._loops["misnamed"] = Misnamed()
    ctx = make_ctx(ScriptedEngine(tiny_tokenizer, {"r0": ["#### 1"]}))
    [t] = asyncio.run(RolloutRunner(ctx, loops).run([("r0", make_row(agent="misnamed"))]))
    assert t.finish_reason is TrajectoryFinish.LOOP_ERROR
    assert t.reward_info["error"].startswith(
        "TrajectoryError: agent loop 'misnamed': play() returned: unknown finish reason 'timeout' (known: stop, "
    )
    with pytest.raises(TrajectoryError, match="EpisodeEnd: unknown finish reason 'done'"):
        EpisodeEnd("done")

"""Malformed calls, every limit with its finish reason, and the tool lifecycle under failure."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import CALL_12x34, make_row

from agentrl.agent.loop import AgentLoop
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tools_runtime import ToolBox

BAD_JSON = "<tool_call>\n{not json}\n</tool_call>"
UNKNOWN = '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>'
INVALID = '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>'


@pytest.mark.parametrize(
    "call,kind,message",
    [
        (BAD_JSON, "bad_json", "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at position 1)"),
        (UNKNOWN, "unknown_tool", "Error: unknown tool 'weather' (available: calculator)"),
        (INVALID, "invalid_arguments", "Error: invalid arguments for calculator: arguments: 'expression' is a required property"),
    ],
)
def test_malformed_call_is_fed_back_by_default_and_counted(run_rows, call, kind, message):
    [t], *_ = run_rows({"r0": [call, "#### 408"]}, [("r0", make_row())])
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == [message]
    assert t.metrics[f"tool_errors/{kind}"] == 1
    assert t.tool_calls[0].error == kind and t.tool_calls[0].raw.startswith("<tool_call>")
    assert t.finish_reason == "stop" and t.turns[0].reward is None


def test_penalize_policy_feeds_back_and_puts_the_penalty_on_the_turn(run_rows):
    [t], *_ = run_rows(
        {"r0": [BAD_JSON, "#### 408"]}, [("r0", make_row())], agent={"malformed_call_policy": "penalize", "malformed_call_penalty": -0.25}
    )
    assert t.turns[0].reward == -0.25
    assert t.messages[3]["content"].startswith("Error: the tool call is not valid JSON")


def test_end_policy_ends_the_trajectory(run_rows):
    [t], *_ = run_rows({"r0": [UNKNOWN, "#### 408"]}, [("r0", make_row())], agent={"malformed_call_policy": "end"})
    assert t.finish_reason == "malformed_tool_call"
    assert [x.role for x in t.turns] == ["assistant"]
    assert t.metrics["tool_errors/unknown_tool"] == 1


def test_unclosed_tool_call_is_malformed_not_dropped(run_rows):
    [t], *_ = run_rows({"r0": ['<tool_call>\n{"name": "calculator"', "#### 408"]}, [("r0", make_row())])
    assert t.messages[3]["content"] == "Error: the tool call was not closed with </tool_call>"
    assert t.metrics["tool_errors/bad_json"] == 1


def test_tool_exception_is_shown_to_the_model(run_rows):
    call = CALL_12x34.replace("12 * 34", "1 / 0")
    [t], *_ = run_rows({"r0": [call, "#### 0"]}, [("r0", make_row())])
    assert t.messages[3]["content"] == "Error: division by zero"
    assert t.metrics["tool_errors/tool_exception"] == 1


def test_max_assistant_turns_ends_before_running_more_calls(run_rows):
    [t], *_ = run_rows({"r0": [CALL_12x34] * 5}, [("r0", make_row())], limits={"max_assistant_turns": 2})
    assert t.finish_reason == "max_assistant_turns"
    assert t.metrics["turns"] == 2 and t.metrics["tool_calls"] == 1
    assert t.metrics["tool_calls_unexecuted"] == 1


def test_max_user_turns_stops_the_interaction(run_rows):
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], *_ = run_rows({"r0": ["#### 1", "#### 2", "#### 3"]}, [("r0", row)], limits={"max_user_turns": 1})
    assert t.finish_reason == "max_user_turns"
    assert [x.role for x in t.turns] == ["assistant", "user", "assistant"]


def test_observation_that_overflows_the_response_budget_ends_the_episode(run_rows):
    # the call is 25 tokens and its result 16: 41 > 40
    [t], _, engine, _ = run_rows({"r0": [CALL_12x34, "#### 408"]}, [("r0", make_row())], limits={"max_response_tokens": 40})
    assert t.finish_reason == "response_budget"
    assert [x.role for x in t.turns] == ["assistant"] and t.turns[0].length == 25
    assert len(t.response_ids) == 26 and t.response_mask[-1] == 0  # + the template's "\n" after <|im_end|>
    assert [r.sampling.max_new_tokens for r in engine.requests] == [40]


def test_next_turn_gets_only_the_remaining_response_budget(run_rows):
    [t], _, engine, _ = run_rows({"r0": [CALL_12x34, "#### 408"]}, [("r0", make_row())], limits={"max_response_tokens": 60})
    assert [r.sampling.max_new_tokens for r in engine.requests] == [60, 60 - 41]
    assert t.finish_reason == "stop"


def test_length_finish_when_a_turn_hits_max_new_tokens(run_rows):
    [t], *_ = run_rows({"r0": ["#### " + "9" * 50]}, [("r0", make_row())], limits={"max_new_tokens": 8})
    assert t.finish_reason == "length"
    assert len(t.response_ids) == 8 and t.response_mask == [1] * 8


def test_a_turn_cut_after_a_whole_call_ends_with_length_keeping_the_call_in_the_message_unexecuted(run_rows):
    [t], _, engine, _ = run_rows({"r0": [CALL_12x34 + " and then some more words", "#### 408"]}, [("r0", make_row())],
                                 limits={"max_new_tokens": 30})
    assert t.finish_reason == "length" and len(engine.requests) == 1
    assert len(t.response_ids) == 30 and t.response_mask == [1] * 30
    assert t.messages[-1]["tool_calls"] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]
    assert t.tool_calls == [] and "tool_calls" not in t.metrics


def test_long_tool_response_is_truncated_by_tokens_with_a_marker(run_rows, tiny_tokenizer):
    call = CALL_12x34.replace("12 * 34", "123456789 * 987654321")
    [t], *_ = run_rows({"r0": [call, "#### 1"]}, [("r0", make_row())], limits={"max_tool_response_tokens": 10})
    shown = t.messages[3]["content"]
    full = str(123456789 * 987654321)
    assert shown == full[:10] + f"...[truncated {len(full) - 10} tokens]"  # one token per digit
    assert t.metrics["tool_responses_truncated"] == 1


class SlowTool(Tool):
    name = "slow"
    parameters = {"type": "object", "properties": {}}

    def __init__(self, **config):
        super().__init__(**config)
        self.created, self.released = [], []

    async def create(self, instance_id, **kwargs):
        self.created.append(instance_id)

    async def execute(self, instance_id, arguments, **kwargs):
        await asyncio.sleep(3600)
        return ToolResult("never")

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class BrokenTool(SlowTool):
    name = "broken"

    async def execute(self, instance_id, arguments, **kwargs):
        raise RuntimeError("kaboom")


def _runner(tiny_tokenizer, make_ctx, tool, script, limits=None, tool_timeout_s=30.0):
    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = make_ctx(engine, tools=(), limits=limits)
    ctx.toolbox = ToolBox({tool.name: tool}, tool_timeout_s=tool_timeout_s)
    return RolloutRunner(ctx, LoopTable("tool_agent"))


def call_of(name):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'


def test_tool_timeout_is_reported_and_the_instance_released(tiny_tokenizer, make_ctx):
    tool = SlowTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, {"r0": [call_of("slow"), "#### 1"]}, tool_timeout_s=0.05)
    row = make_row(tools_kwargs={"slow": {}})
    [t] = asyncio.run(runner.run([("r0", row)]))
    assert t.messages[3]["content"] == "Error: slow timed out after 0.05 s"
    assert t.metrics["tool_errors/timeout"] == 1
    assert tool.created == tool.released and len(tool.created) == 1


def test_tool_that_raises_is_released_and_reported(tiny_tokenizer, make_ctx):
    tool = BrokenTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, {"r0": [call_of("broken"), "#### 1"]})
    [t] = asyncio.run(runner.run([("r0", make_row(tools_kwargs={"broken": {}}))]))
    assert t.messages[3]["content"] == "Error: broken failed: RuntimeError: kaboom"
    assert tool.created == tool.released == [tool.created[0]]


def test_cancelled_rollout_still_releases_every_tool_instance(tiny_tokenizer, make_ctx):
    tool = SlowTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, lambda *a: call_of("slow"))
    rows = [(f"r{i}", make_row(tools_kwargs={"slow": {}})) for i in range(3)]

    async def main():
        task = asyncio.create_task(runner.run(rows))
        while len(tool.created) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sorted(tool.released) == sorted(tool.created) and len(tool.created) == 3


def test_trajectory_timeout_ends_the_episode_and_releases(tiny_tokenizer, make_ctx):
    tool = SlowTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, {"r0": [call_of("slow")]}, {"trajectory_timeout_s": 0.1})
    [t] = asyncio.run(runner.run([("r0", make_row(tools_kwargs={"slow": {}}))]))
    assert t.finish_reason == "trajectory_timeout"
    assert tool.released == tool.created


def test_interaction_that_raises_ends_with_interaction_error(run_rows, monkeypatch):
    from agentrl_interactions.gsm8k import Gsm8kInteraction

    async def boom(self, instance_id, messages):
        raise ValueError("grader down")

    monkeypatch.setattr(Gsm8kInteraction, "generate_response", boom)
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], *_ = run_rows({"r0": ["#### 408"]}, [("r0", row)])
    assert t.finish_reason == "interaction_error"
    assert t.reward_info["error"] == "ValueError: grader down"


def test_unknown_agent_names_are_reported_before_generation():
    from agentrl.agent.runner import check_agent_names

    assert check_agent_names(["tool_agent", "single_turn_agent", None]) == []
    [problem] = check_agent_names(["tool_agent", "planner"])
    assert problem.startswith("unknown agent_name 'planner' (known loops: ")


def test_custom_loop_subclass_runs_through_the_runner(tiny_tokenizer, make_ctx):
    class EchoLoop(AgentLoop):
        name = "echo"

        async def play(self, episode):
            _, _, text = await episode.generate()
            episode.messages.append({"role": "assistant", "content": text})
            episode.own_score = 0.5
            return "stop"

    engine = ScriptedEngine(tiny_tokenizer, {"r0": ["hi"]})
    ctx = make_ctx(engine)
    table = LoopTable("tool_agent")
    table._loops["echo"] = EchoLoop()
    [t] = asyncio.run(RolloutRunner(ctx, table).run([("r0", make_row(agent="echo"))]))
    assert t.agent_name == "echo" and t.reward == 0.5


class CountingTool(SlowTool):
    """Records how many of its calls run at once."""

    name = "counting"
    parameters = {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}

    def __init__(self, **config):
        super().__init__(**config)
        self.active = self.peak = 0

    async def execute(self, instance_id, arguments, **kwargs):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.01)
        self.active -= 1
        return ToolResult(f"done {arguments['i']}", reward=0.25)


def test_parallel_calls_run_at_most_max_parallel_calls_at_once_and_keep_their_order(tiny_tokenizer, make_ctx):
    tool = CountingTool()
    calls = "\n".join(f'<tool_call>\n{{"name": "counting", "arguments": {{"i": {i}}}}}\n</tool_call>' for i in range(5))
    engine = ScriptedEngine(tiny_tokenizer, {"r0": [calls, "#### 1"]})
    ctx = make_ctx(engine, tools=())
    ctx.toolbox = ToolBox({tool.name: tool}, max_parallel_calls=2)
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row(tools_kwargs={"counting": {}}))]))
    assert tool.peak == 2
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == [f"done {i}" for i in range(5)]
    assert t.turns[0].reward == 1.25  # the five step rewards, on the calling turn
    assert t.metrics["tool_calls"] == 5


class FailingCreateTool(SlowTool):
    name = "failing_create"

    async def create(self, instance_id, **kwargs):
        self.created.append(instance_id)
        raise OSError("no sandbox slot")


def test_tool_whose_create_fails_is_still_released_and_the_trajectory_is_recorded(tiny_tokenizer, make_ctx):
    tool = FailingCreateTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, {"r0": ["#### 1"]})
    [t] = asyncio.run(runner.run([("r0", make_row(tools_kwargs={"failing_create": {}}))]))
    assert t.finish_reason == "loop_error" and t.reward_info["error"] == "OSError: no sandbox slot"
    assert tool.released == tool.created and len(tool.created) == 1


class BadRewardTool(SlowTool):
    name = "bad_reward"

    async def calc_reward(self, instance_id, **kwargs):
        raise ValueError("no reward today")


def test_calc_reward_that_raises_is_recorded_and_the_trajectory_survives(tiny_tokenizer, make_ctx):
    tool = BadRewardTool()
    runner = _runner(tiny_tokenizer, make_ctx, tool, {"r0": ["#### 408"]})
    [t] = asyncio.run(runner.run([("r0", make_row(tools_kwargs={"bad_reward": {}}))]))
    assert t.finish_reason == "stop" and t.reward == 1.0
    assert t.reward_info["tool_reward_errors"] == {"bad_reward": "ValueError: no reward today"}
    assert t.metrics["tool_errors/calc_reward"] == 1
    assert tool.released == tool.created


def test_interaction_is_finalized_even_when_its_start_fails(run_rows, monkeypatch):
    from agentrl_interactions.gsm8k import Gsm8kInteraction

    finalized = []

    async def bad_start(self, instance_id, **kwargs):
        raise RuntimeError("no grader")

    async def finalize(self, instance_id):
        finalized.append(instance_id)

    monkeypatch.setattr(Gsm8kInteraction, "start", bad_start)
    monkeypatch.setattr(Gsm8kInteraction, "finalize", finalize)
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], *_ = run_rows({"r0": ["#### 408"]}, [("r0", row)])
    assert t.finish_reason == "interaction_error"
    assert t.reward_info["error"] == "start failed: RuntimeError: no grader"
    assert len(finalized) == 1


def test_a_tool_named_by_the_row_but_not_configured_is_loaded_once_for_the_worker(run_rows):
    row = make_row(tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "408"}}})
    call = '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "408"}}\n</tool_call>'
    trajectories, ctx, *_ = run_rows({"r0": [call, "#### 408"], "r1": [call, "#### 408"]}, [("r0", row), ("r1", row)])
    assert [t.turns[0].reward for t in trajectories] == [1.0, 1.0]
    assert sorted(ctx.toolbox.tools) == ["calculator", "check_answer"]


def test_a_row_naming_a_tool_that_is_not_installed_is_an_error_naming_it(run_rows):
    [t], *_ = run_rows({"r0": ["#### 1"]}, [("r0", make_row(tools_kwargs={"telescope": {}}))])
    assert t.finish_reason == "loop_error"
    assert "no plugin named 'telescope' in group agentrl.tools" in t.reward_info["error"]


def test_row_plugin_check_names_each_unknown_plugin_and_its_field():
    from agentrl.agent.runner import check_row_plugins

    assert check_row_plugins(make_row(interaction_kwargs={"name": "gsm8k"})) == []
    row = make_row(agent="planner", tools_kwargs={"calculator": {}, "telescope": {}}, interaction_kwargs={"name": "oracle"})
    fields = [field for field, _ in check_row_plugins(row)]
    assert fields == ["agent_name", "extra_info.tools_kwargs.telescope", "extra_info.interaction_kwargs.name"]
    assert check_row_plugins(row)[1][1].startswith("unknown tool 'telescope' (known: ")


class RecordingTool(SlowTool):
    name = "recording"

    async def execute(self, instance_id, arguments, **kwargs):
        return ToolResult("ok")


def test_tool_instance_ids_are_the_trajectorys_identity_the_same_in_every_context(tiny_tokenizer, make_ctx):
    # two workers' contexts (both alive, as in two processes) running the same rows give each
    # trajectory the same instance id: a tool can seed from it
    rows = [("r0", make_row(tools_kwargs={"recording": {}})), ("r1", make_row(tools_kwargs={"recording": {}}))]
    seen = []
    runners = []
    for _ in range(2):
        tool = RecordingTool()
        runners.append(_runner(tiny_tokenizer, make_ctx, tool, lambda *a: call_of("recording")))
        asyncio.run(runners[-1].run(rows, n=2, group_prefix="train3/"))
        seen.append(sorted(tool.created))
    assert seen[0] == seen[1] == ["train3/0:r0#0", "train3/0:r0#1", "train3/1:r1#0", "train3/1:r1#1"]


async def _forever(*args, **kwargs):
    await asyncio.Event().wait()


@pytest.mark.parametrize("step", ["start", "calculate_score"])
def test_an_interaction_step_that_never_answers_ends_the_episode_naming_it_and_the_key(run_rows, monkeypatch, step):
    """start and calculate_score run outside the turns agent.trajectory_timeout_s bounds: each has
    agent.tool_timeout_s, and the trajectory ends interaction_error instead of waiting for ever."""
    from agentrl_interactions.gsm8k import Gsm8kInteraction

    finalized = []

    async def finalize(self, instance_id):
        finalized.append(instance_id)

    monkeypatch.setattr(Gsm8kInteraction, step, _forever)
    monkeypatch.setattr(Gsm8kInteraction, "finalize", finalize)
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], *_ = run_rows({"r0": ["#### 408"]}, [("r0", row)], agent={"tool_timeout_s": 0.05})
    assert t.finish_reason == "interaction_error"
    assert t.reward_info["error"] == (
        f"{step} failed: TimeoutError: interaction 'gsm8k': {step} did not finish within agent.tool_timeout_s=0.05 s"
    )
    assert len(finalized) == 1


def test_a_finalize_that_never_answers_keeps_the_trajectory_and_says_so(run_rows, monkeypatch, caplog):
    from agentrl_interactions.gsm8k import Gsm8kInteraction

    monkeypatch.setattr(Gsm8kInteraction, "finalize", _forever)
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], *_ = run_rows({"r0": ["#### 408"]}, [("r0", row)], agent={"tool_timeout_s": 0.05})
    assert t.finish_reason == "interaction_done" and t.reward_info["interaction_score"] == 1.0
    assert "interaction 'gsm8k': finalize did not finish within agent.tool_timeout_s=0.05 s" in caplog.text

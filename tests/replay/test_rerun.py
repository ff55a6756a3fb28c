"""Re-run: stored trajectories driven back through their loops by ReplayEngine."""

from __future__ import annotations

import asyncio

import pytest
from replay_data import SCRIPT, call, make_row

from agentrl.agent.runner import LoopTable
from agentrl.agent.tool import ToolResult
from agentrl.engines.base import FinishReason, GenerateRequest, SamplingParams
from agentrl.errors import DataError, EngineError
from agentrl.replay.rerun import ReplayEngine, rerun_trajectories
from agentrl.data.rollout_store import RolloutStore
from agentrl_tools.calculator import CalculatorTool


def stored_rollout(rollout, rows, script, tmp_path, *, n=1):
    store = RolloutStore(tmp_path)
    store.write_step(0, rollout(script, rows, n=n), rows=rows)
    return list(store.iter_stored())


def test_rerun_of_deterministic_tools_and_interactions_matches_token_for_token(rollout, sample_rows, make_ctx, tmp_path):
    records = stored_rollout(rollout, sample_rows, SCRIPT, tmp_path, n=2)
    results = asyncio.run(rerun_trajectories(records, make_ctx(None), LoopTable("tool_agent")))
    assert [r.differences for r in results] == [[]] * 6
    for r in results:  # the re-run is the stored trajectory itself (timings aside)
        stored, new = r.stored.trajectory, r.rerun
        assert (new.prompt_ids, new.response_ids, new.response_mask, new.logprobs, new.turns, new.messages, new.reward) == (
            stored.prompt_ids, stored.response_ids, stored.response_mask, stored.logprobs, stored.turns, stored.messages, stored.reward)
    # the react trajectory was served line by line (its turn sampled in pieces), the retry by turns
    assert {r.stored.trajectory.agent_name for r in results} == {"tool_agent", "react"}


class OffByOneCalculator(CalculatorTool):
    """The calculator after a bad change: every result is one too high."""

    async def execute(self, instance_id, arguments, **kwargs):
        result = await super().execute(instance_id, arguments, **kwargs)
        return ToolResult(text=str(int(result.text) + 1), reward=result.reward, metrics=result.metrics)


def test_a_changed_tool_is_flagged_at_the_turn_whose_observation_differs(rollout, sample_rows, make_ctx, tiny_tokenizer, tmp_path):
    records = stored_rollout(rollout, sample_rows[:1], SCRIPT, tmp_path)
    ctx = make_ctx(None)
    ctx.toolbox.tools["calculator"] = OffByOneCalculator()
    [result] = asyncio.run(rerun_trajectories(records, ctx, LoopTable("tool_agent"), decode=tiny_tokenizer.decode))
    assert not result.matches
    kinds = [(d.kind, d.turn) for d in result.differences]
    assert kinds == [("observation", 1), ("tool_call", 0)]
    observation = result.differences[0]
    assert "408" in tiny_tokenizer.decode(list(observation.stored_ids)) and "409" in tiny_tokenizer.decode(list(observation.rerun_ids))
    assert "turn 1 (tool) tokens differ" in observation.detail and "409" in observation.detail
    assert "returned '408'" in result.differences[1].detail and "re-run '409'" in result.differences[1].detail


def test_a_changed_interaction_that_wants_more_turns_than_stored_is_flagged(rollout, make_ctx, tiny_tokenizer, tmp_path):
    rows = [("r0", make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"}))]
    records = stored_rollout(rollout, rows, {"r0": ["#### 408"]}, tmp_path)
    assert records[0].trajectory.finish_reason == "interaction_done"
    ctx = make_ctx(None)
    ctx.interactions.session = _always_wrong(ctx.interactions.session)
    [result] = asyncio.run(rerun_trajectories(records, ctx, LoopTable("tool_agent"), decode=tiny_tokenizer.decode))
    assert [(d.kind, d.turn) for d in result.differences] == [("turn_reward", 0), ("turns", 1), ("finish_reason", None)]
    reward, extra, finish = (d.detail for d in result.differences)
    assert reward == "turn 0 (assistant) reward was 1.0, re-run 0.0"
    assert extra.startswith("turn 1 (user) is only in the re-run: ") and "Your response is incorrect!" in extra
    assert finish.startswith("finished with interaction_done, re-run with engine_error")
    assert "asks for assistant turn 2, but only 1 were stored" in finish


def _always_wrong(make_session):
    """Interaction sessions whose judge now rejects every answer (a changed interaction plugin)."""

    def session(instance_id, kwargs):
        s = make_session(instance_id, {**kwargs, "ground_truth": "-1"})
        return s

    return session


def test_a_trajectory_met_at_two_steps_is_rerun_once_per_step(rollout, make_ctx, tmp_path):
    rows = [("r0", make_row())]
    store = RolloutStore(tmp_path)
    store.write_step(0, rollout({"r0": [call("12 * 34"), "#### 408"]}, rows), rows=rows)
    store.write_step(1, rollout({"r0": ["#### 400"]}, rows), rows=rows)
    records = list(store.iter_stored())
    results = asyncio.run(rerun_trajectories(records, make_ctx(None), LoopTable("tool_agent")))
    assert [r.matches for r in results] == [True, True]
    assert [r.rerun.reward for r in results] == [1.0, 0.0]


def test_trajectories_stored_without_rows_cannot_be_rerun_and_say_why(rollout, make_ctx, tmp_path):
    store = RolloutStore(tmp_path)
    store.write_step(0, rollout({"r0": ["#### 408"]}, [("r0", make_row())]))
    with pytest.raises(DataError, match=r"r0#0 \(step 0\) was stored without its dataset row.*rows=\.\.\."):
        asyncio.run(rerun_trajectories(list(store.iter_stored()), make_ctx(None), LoopTable("tool_agent")))


def test_replay_engine_serves_stored_turns_by_session_cut_at_stop_tokens_and_limits(rollout, tmp_path):
    [t] = rollout({"r0": [call("1+1"), "#### 2"]}, [("r0", make_row())])
    engine = ReplayEngine([t])
    first = t.response_ids[t.turns[0].start : t.turns[0].end]
    second = t.response_ids[t.turns[2].start : t.turns[2].end]

    def ask(max_new_tokens, stops=(first[-1],)):
        request = GenerateRequest([1], SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stops), session_id="r0#0")
        return asyncio.run(engine.generate(request))

    a = ask(3)
    assert (a.output_ids, a.finish_reason) == (first[:3], FinishReason.LENGTH)
    b = ask(100)  # the rest of the same turn, up to and with its stop token
    assert (b.output_ids, b.finish_reason, b.matched_stop) == (first[3:], FinishReason.STOP, first[-1])
    assert b.logprobs == t.logprobs[3 : len(first)]
    c = ask(100)
    assert c.output_ids == second and engine.unserved("r0#0") == 0
    with pytest.raises(EngineError, match="asks for assistant turn 3, but only 2 were stored"):
        ask(100)
    with pytest.raises(EngineError, match="no stored trajectory for session 'zz#0'"):
        asyncio.run(engine.generate(GenerateRequest([1], session_id="zz#0")))

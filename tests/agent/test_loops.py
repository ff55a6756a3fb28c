"""Built-in loops end to end with the scripted engine: exact tokens, masks, spans and rewards."""

from __future__ import annotations

from agent_helpers import CALL_12x34, make_row

from agentrl_interactions.gsm8k import CORRECT, INCORRECT


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_tool_agent_stream_is_exact_tokens_masks_logprobs_and_spans(run_rows, tiny_tokenizer):
    tok = tiny_tokenizer
    [t], ctx, engine, _ = run_rows({"r0": [CALL_12x34, "#### 408"]}, [("r0", make_row())])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    call_ids = enc(tok, CALL_12x34) + [eos]
    obs_ids = enc(tok, "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    answer_ids = enc(tok, "#### 408") + [eos]
    sep = enc(tok, "\n")
    assert t.response_ids == call_ids + obs_ids + answer_ids + sep
    assert t.response_mask == [1] * len(call_ids) + [0] * len(obs_ids) + [1] * len(answer_ids) + [0]
    assert t.logprobs == [-0.5] * len(call_ids) + [0.0] * len(obs_ids) + [-0.5] * len(answer_ids) + [0.0]
    a, b = len(call_ids), len(call_ids) + len(obs_ids)
    assert [(x.role, x.start, x.end) for x in t.turns] == [
        ("assistant", 0, a), ("tool", a, b), ("assistant", b, b + len(answer_ids))
    ]
    assert t.finish_reason == "stop"
    assert t.reward == 1.0
    assert t.metrics["tool_calls"] == 1 and t.metrics["turns"] == 2
    assert [c.name for c in t.tool_calls] == ["calculator"] and t.tool_calls[0].result == "408"
    # the engine was asked with exactly prompt + stream so far, stopping at <|im_end|>
    assert engine.requests[1].input_ids == t.prompt_ids + call_ids + obs_ids
    assert engine.requests[0].sampling.stop_token_ids == (eos,)


def test_tool_agent_final_stream_equals_the_template_rendering(run_rows):
    script = {"r0": ["Let me compute.\n" + CALL_12x34 + "\n" + CALL_12x34.replace("12 * 34", "408 + 1"), "#### 409"]}
    [t], ctx, _, _ = run_rows(script, [("r0", make_row(answer="409"))])
    rendered = ctx.renderer.render_ids(t.messages, ctx.toolbox.schemas(["calculator"]))
    assert t.prompt_ids + t.response_ids == rendered
    assert t.metrics["tool_calls"] == 2
    assert [m["content"] for m in t.messages if m["role"] == "tool"] == ["408", "409"]


def test_single_turn_loop_answers_once_without_tools_in_the_prompt(run_rows, tiny_tokenizer):
    [t], ctx, _, _ = run_rows({"r0": ["#### 408"]}, [("r0", make_row(agent="single_turn_agent"))])
    assert t.agent_name == "single_turn"
    assert "<tools>" not in tiny_tokenizer.decode(t.prompt_ids)
    assert [x.role for x in t.turns] == ["assistant"]
    assert t.reward == 1.0
    assert t.prompt_ids + t.response_ids == ctx.renderer.render_ids(t.messages)


def test_react_loop_runs_actions_line_by_line_with_masked_observations(run_rows, tiny_tokenizer):
    tok = tiny_tokenizer
    script = {"r0": ["Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\n", "Final Answer: #### 408\n"]}
    [t], ctx, engine, _ = run_rows(script, [("r0", make_row(agent="react"))])
    assert t.agent_name == "react" and t.finish_reason == "stop" and t.reward == 1.0
    text = tok.decode(t.response_ids)
    assert text == (
        "Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\nObservation: 408\n"
        "Final Answer: #### 408\n<|im_end|>\n"
    )
    observed = tok.decode([i for i, m in zip(t.response_ids, t.response_mask) if m == 0])
    assert observed == "Observation: 408\n<|im_end|>\n"
    assert [x.role for x in t.turns] == ["assistant", "tool", "assistant"]
    assert "<tools>" not in tok.decode(t.prompt_ids) and "- calculator:" in tok.decode(t.prompt_ids)
    assert t.prompt_ids + t.response_ids == ctx.renderer.render_ids(t.messages)
    assert len(engine.requests) == 4  # one generate call per line


def test_interaction_tells_the_model_it_is_wrong_and_lets_it_retry(run_rows, tiny_tokenizer):
    row = make_row(interaction_kwargs={"name": "gsm8k", "query": "q", "ground_truth": "408"})
    [t], ctx, _, _ = run_rows({"r0": ["#### 400", "#### 408"]}, [("r0", row)])
    assert t.finish_reason == "interaction_done"
    assert [m["content"] for m in t.messages if m["role"] == "user"][-2:] == [INCORRECT, CORRECT]
    assert [x.role for x in t.turns] == ["assistant", "user", "assistant"]
    assert [x.reward for x in t.turns if x.role == "assistant"] == [0.0, 1.0]
    assert t.reward == 1.0
    assert t.reward_info["interaction_score"] == 1.0  # calculate_score, recorded beside the reward
    user_text = tiny_tokenizer.decode(t.response_ids[t.turns[1].start : t.turns[1].end])
    assert user_text == f"\n<|im_start|>user\n{INCORRECT}<|im_end|>\n<|im_start|>assistant\n"
    # the final reply is a record of how the episode ended, never in the token stream
    assert t.prompt_ids + t.response_ids == ctx.renderer.render_ids(t.messages[:-1], ctx.toolbox.schemas(["calculator"]))


def test_interaction_correct_first_time_ends_with_reward_one(run_rows, tiny_tokenizer):
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    [t], ctx, *_ = run_rows({"r0": ["#### 408"]}, [("r0", row)])
    assert t.finish_reason == "interaction_done"
    assert t.turns[0].reward == 1.0
    answer = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [ctx.renderer.eos_id]
    sep = ctx.renderer.separator_ids
    assert (t.response_ids, t.response_mask) == (answer + sep, [1] * len(answer) + [0] * len(sep))
    # done: the reply ends the messages (how the episode ended), and the token stream ends with the answer
    assert t.messages[-2:] == [{"role": "assistant", "content": "#### 408"}, {"role": "user", "content": CORRECT}]
    assert CORRECT not in tiny_tokenizer.decode(t.response_ids) and t.turns[-1].role == "assistant"


def test_tool_step_reward_lands_on_the_calling_turn(run_rows):
    row = make_row(tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "408"}}})
    call = '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "408"}}\n</tool_call>'
    [t], *_ = run_rows({"r0": [call, "#### 408"]}, [("r0", row)], tools=("calculator", "check_answer"))
    assert t.turns[0].reward == 1.0 and t.turns[2].reward is None
    assert t.reward_info["tool_rewards"] == {"check_answer": 1.0}


def test_reward_components_weigh_the_score_the_tools_calc_reward_and_the_interaction_score(run_rows):
    """reward.components: reward = 0.5 * score + 0.25 * sum(calc_reward) + 2 * calculate_score. The
    check_answer tool judges the answer it was given (calc_reward 0 for 400, 1 for 408); the final
    '#### 408' scores 1 with the gsm8k reward and the interaction's calculate_score is 1."""
    weights = {"components": {"score": 0.5, "tool_calc_reward": 0.25, "interaction_score": 2.0}}

    def check(answer: str) -> str:
        return f'<tool_call>\n{{"name": "check_answer", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>'

    rows = [(f"r{answer}", make_row(tools_kwargs={"check_answer": {"create_kwargs": {"ground_truth": "408"}}},
                                    interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})) for answer in ("400", "408")]
    script = {"r400": [check("400"), "#### 408"], "r408": [check("408"), "#### 408"]}
    wrong_tool, right_tool = run_rows(script, rows, tools=("check_answer",), reward=weights)[0]
    for t, calc in ((wrong_tool, 0.0), (right_tool, 1.0)):
        assert t.finish_reason == "interaction_done"
        assert t.reward_info["tool_rewards"] == {"check_answer": calc} and t.reward_info["interaction_score"] == 1.0
        assert t.reward_info["score"] == 1.0  # the reward function's own score, kept beside the composed reward
    assert wrong_tool.reward == 0.5 * 1.0 + 0.25 * 0.0 + 2.0 * 1.0
    assert right_tool.reward == 0.5 * 1.0 + 0.25 * 1.0 + 2.0 * 1.0
    # the default is verl's: the score alone, the other judgements only recorded
    [plain], *_ = run_rows({"r408": [check("408"), "#### 408"]}, rows[1:], tools=("check_answer",))
    assert plain.reward == 1.0 and "score" not in plain.reward_info


def test_runner_groups_samples_and_keeps_row_order(run_rows):
    rows = [(f"r{i}", make_row()) for i in range(3)]
    script = lambda row_id, index, request: "#### 408"  # noqa: E731
    trajectories, *_ = run_rows(script, rows, n=2)
    assert [(t.row_id, t.sample_index) for t in trajectories] == [(f"r{i}", s) for i in range(3) for s in range(2)]
    groups = [t.group_id for t in trajectories]
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4]


def test_runner_respects_its_concurrency_cap(run_rows):
    rows = [(f"r{i}", make_row()) for i in range(40)]
    trajectories, _, _, runner = run_rows(lambda *a: "#### 408", rows, concurrency=5)
    assert len(trajectories) == 40
    assert runner.inflight_max == 5


def test_a_loop_that_raises_is_recorded_not_dropped(run_rows):
    [t], *_ = run_rows({}, [("missing", make_row())])  # the script has no answer: the engine errors
    assert t.finish_reason == "engine_error"
    assert "no script for row 'missing'" in t.reward_info["error"]


def test_a_trajectory_records_the_weight_versions_that_sampled_it(tiny_tokenizer, make_ctx):
    import asyncio

    from agentrl.agent.runner import LoopTable, RolloutRunner
    from agentrl.agent.scripted import ScriptedEngine

    class SyncedMidEpisode(ScriptedEngine):
        """The weights move to version 7 after the first call (as a sync during a long episode would)."""

        async def generate(self, request):
            result = await super().generate(request)
            self.weight_version = 7
            return result

    engine = SyncedMidEpisode(tiny_tokenizer, {"r0": [CALL_12x34, "#### 408"]})
    engine.weight_version = 6
    runner = RolloutRunner(make_ctx(engine), LoopTable("tool_agent"), max_concurrency=1)
    (t,) = asyncio.run(runner.run([("r0", make_row())], n=1))
    assert t.metrics["generate_calls"] == 2
    assert (t.metrics["weight_version_min"], t.metrics["weight_version_max"]) == (6.0, 7.0)


def test_a_tool_results_metrics_are_kept_on_its_call_record_and_aggregated_per_tool(run_rows):
    from agentrl.trainer.step import trajectory_metrics

    ok = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    fails = '<tool_call>\n{"name": "python", "arguments": {"code": "raise SystemExit(3)"}}\n</tool_call>'
    [t], *_ = run_rows({"r0": [ok, fails, "#### 1"]}, [("r0", make_row(tools_kwargs={"python": {"create_kwargs": {}}}))], tools=("python",))
    assert [c.metrics["exit_code"] for c in t.tool_calls] == [0.0, 3.0]
    assert [c.metrics["timed_out"] for c in t.tool_calls] == [0.0, 0.0]
    m = trajectory_metrics([t])
    assert m["tool/python/calls"] == 2.0 and m["tool/python/exit_code"] == 1.5 and m["tool/python/timed_out"] == 0.0


def test_react_segments_count_in_the_parse_rate_once_each(run_rows):
    """A ReAct segment is parsed at every line; it is counted once, where it ends: a call read
    whole, a call to an unknown tool, and an Action that never got its input before the answer."""
    script = {"r0": [
        "Thought: use the tool\nAction: calculator\nAction Input: 12 * 34\n",
        "Action: abacus\nAction Input: 12 * 34\n",
        "Action: calculator\nFinal Answer: #### 408\n",
    ]}
    [t], *_ = run_rows(script, [("r0", make_row(agent="react"))])
    assert t.finish_reason == "stop"
    counted = {k: v for k, v in t.metrics.items() if k.startswith("tool_calls/")}
    assert counted == {"tool_calls/parsed": 1, "tool_calls/malformed/unknown_tool": 1, "tool_calls/unparsed_turns": 1}

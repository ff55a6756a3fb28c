"""Roles through the OpenAI endpoint (agentrl.agent.openai_roles), driven by the plain ``openai``
client: the request's ``model`` names the role, each role's calls are its own exact trajectory."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agent_helpers import loop_with, make_row

from agentrl.agent.program import AgentResult
from agentrl.agent.scripted import ScriptedEngine

ANSWERS = {"solver": "#### 408", "verifier": "#### correct"}
VERIFIER = [{"role": "system", "content": "Check the answer."}, {"role": "user", "content": "What is 12 * 34? Answer: #### 408"}]


def script(row_id, index, request):
    return ANSWERS[request.session_id.rsplit("@", 1)[1]]


def run_program(ctx, program):
    return asyncio.run(loop_with(program).run(make_row(agent="openai_agent"), ctx, row_id="r0", group_id="g"))


def test_the_model_field_names_the_role_and_each_role_is_its_own_exact_trajectory(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = make_ctx(engine, tools=(), agent={"roles": {"solver": "shared", "verifier": "shared"}})
    seen = {}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        answer = client.chat.completions.create(model="solver", messages=task.messages)
        verdict = client.chat.completions.create(model="verifier", messages=VERIFIER)
        seen["models"] = [answer.model, verdict.model]
        with pytest.raises(openai.BadRequestError, match=r"model: 'judge' names no role of this episode \(roles: solver, verifier\)"):
            client.chat.completions.create(model="judge", messages=VERIFIER)
        return AgentResult(final_answer=verdict.choices[0].message.content, reward={"solver": 1.0, "verifier": 0.25})

    solver, verifier = run_program(ctx, program)
    r = ctx.renderer
    assert seen["models"] == ["solver", "verifier"]
    assert [(t.role, t.group_id, t.reward, t.finish_reason) for t in (solver, verifier)] == [
        ("solver", "g@solver", 1.0, "stop"), ("verifier", "g@verifier", 0.25, "stop")]
    for t, prompt, text in [(solver, make_row().messages(), "#### 408"), (verifier, VERIFIER, "#### correct")]:
        sampled = tiny_tokenizer.encode(text, add_special_tokens=False) + [r.eos_id]
        assert t.prompt_ids == r.prompt_ids(prompt)
        assert t.response_ids == sampled + r.separator_ids
        assert t.response_mask == [1] * len(sampled) + [0] * len(r.separator_ids)
        assert t.token_versions == [0] * len(sampled) + [-1] * len(r.separator_ids)
        assert t.metrics["generate_calls"] == 1.0
    assert [q.session_id for q in engine.requests] == ["r0#0@solver", "r0#0@verifier"]


def test_a_frozen_role_is_refused_and_a_reward_function_may_answer_by_role(tiny_tokenizer, make_ctx, monkeypatch):
    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = make_ctx(engine, tools=(), agent={"roles": {"solver": "shared", "verifier": "frozen"}})
    ctx.reward_fn = lambda source: lambda ds, solution, gt, extra: {"solver": 0.5 if solution == "#### 408" else 0.0}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        answer = client.chat.completions.create(model="solver", messages=task.messages)
        with pytest.raises(openai.BadRequestError, match="model: role 'verifier' is frozen"):
            client.chat.completions.create(model="verifier", messages=VERIFIER)
        return answer.choices[0].message.content

    [solver] = run_program(ctx, program)
    assert (solver.role, solver.reward, solver.finish_reason) == ("solver", 0.5, "stop")

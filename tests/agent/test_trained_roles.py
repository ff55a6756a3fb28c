"""A role marked ``trained`` samples from a policy of its own (agentrl.agent.roles, docs/roles.md):
its requests name the role as their policy, the engine of that policy answers them, and its
trajectory carries that policy's weight version; the shared roles stay on the main policy. Through
a built-in loop and through the OpenAI endpoint, each policy a scripted engine of its own."""

from __future__ import annotations

import asyncio

import openai
from agent_helpers import loop_with, make_row

from agentrl.agent.program import AgentResult
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.engines.policies import PolicyEngines

ANSWERS = {"solver": "#### 408", "verifier": "#### 1"}


def script(row_id, index, request):
    return ANSWERS[request.session_id.rsplit("@", 1)[1]]


def engines(tiny_tokenizer):
    """The main policy at weight version 3, the verifier's own at version 7."""
    main, verifier = ScriptedEngine(tiny_tokenizer, script), ScriptedEngine(tiny_tokenizer, script)
    main.weight_version, verifier.weight_version = 3, 7
    return main, verifier, PolicyEngines({"": main, "verifier": verifier})


def test_a_trained_roles_turns_are_sampled_by_its_own_policy_and_carry_its_version(tiny_tokenizer, make_ctx):
    main, verifier_engine, served = engines(tiny_tokenizer)
    ctx = make_ctx(served, agent={"roles": {"verifier": "trained"}})
    ctx.policy_version, ctx.policy_versions = 3, {"verifier": 7}
    solver, verifier = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r0", make_row(agent="solver_verifier"))], n=1))
    # each policy's engine answered its own role's requests only (PolicyEngines routed them by policy)
    assert [q.session_id for q in main.requests] == ["r0#0@solver"]
    # the verifier's two turns (solver_verifier: its own working, then its verdict on the told answer)
    assert [q.session_id for q in verifier_engine.requests] == ["r0#0@verifier"] * 2
    sampled = {text: len(tiny_tokenizer.encode(text, add_special_tokens=False)) + 1 for text in ANSWERS.values()}
    assert (solver.role, solver.policy_version, solver.group_id) == ("solver", 3, "0:r0@solver")
    assert solver.token_versions[: sampled["#### 408"]] == [3] * sampled["#### 408"]
    assert (verifier.role, verifier.policy_version, verifier.group_id) == ("verifier", 7, "0:r0@verifier")
    assert verifier.token_versions[: sampled["#### 1"]] == [7] * sampled["#### 1"]
    assert (verifier.metrics["weight_version_min"], verifier.metrics["weight_version_max"]) == (7.0, 7.0)


def test_a_trained_roles_calls_through_the_openai_endpoint_go_to_its_own_policy(tiny_tokenizer, make_ctx):
    main, verifier_engine, served = engines(tiny_tokenizer)
    ctx = make_ctx(served, tools=(), agent={"roles": {"solver": "shared", "verifier": "trained"}})
    ctx.policy_version, ctx.policy_versions = 3, {"verifier": 7}

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        answer = client.chat.completions.create(model="solver", messages=task.messages)
        verdict = client.chat.completions.create(model="verifier", messages=[{"role": "user", "content": "Check: #### 408"}])
        return AgentResult(final_answer=verdict.choices[0].message.content, reward={"solver": 1.0, "verifier": 0.5})

    solver, verifier = asyncio.run(loop_with(program).run(make_row(agent="openai_agent"), ctx, row_id="r0", group_id="g"))
    # each policy's engine answered its own role's requests only (PolicyEngines routed them by policy)
    assert [q.session_id for q in main.requests] == ["r0#0@solver"]
    assert [q.session_id for q in verifier_engine.requests] == ["r0#0@verifier"]
    assert [(t.role, t.policy_version, t.reward) for t in (solver, verifier)] == [("solver", 3, 1.0), ("verifier", 7, 0.5)]
    assert set(verifier.token_versions) == {7, -1} and set(solver.token_versions) == {3, -1}  # -1: the template's separator

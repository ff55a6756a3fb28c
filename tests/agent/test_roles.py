"""Several roles in one episode (agentrl.agent.roles, agent_loops/solver_verifier.py): a token
stream per role, exact as a single agent's; groups, rewards and metrics per role; frozen roles."""

from __future__ import annotations

import asyncio
import dataclasses

import pyarrow.parquet as pq
import pytest

from agentrl.agent.roles import role_metrics, role_policies
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine
from agentrl.data.rollout_store import RolloutStore
from agentrl.errors import ConfigError
from agentrl_agent_loops.solver_verifier import verdict_of
from tests.agent.agent_helpers import CALL_12x34, make_row

ROW = make_row(agent="solver_verifier")


def script_by_role(answers: dict[str, list[str]]):
    """A scripted engine script: each role's session (``<row>#<sample>@<role>``) walks its own list,
    the list of ``"<role>/<sample>"`` when there is one."""

    def script(row_id, index, request):
        sample_role = request.session_id.rsplit("#", 1)[1]
        sample, role = sample_role.split("@")
        return answers.get(f"{role}/{sample}", answers.get(role))[index]

    return script


def roll(tiny_tokenizer, make_ctx, answers, *, n=1, agent=None, reward=None):
    engine = ScriptedEngine(tiny_tokenizer, script_by_role(answers))
    ctx = make_ctx(engine, agent=agent, reward=reward)
    runner = RolloutRunner(ctx, LoopTable("tool_agent"))
    return asyncio.run(runner.run([("r0", ROW)], n=n)), ctx, engine


def test_each_role_has_its_own_exact_token_stream_group_and_reward(tiny_tokenizer, make_ctx):
    answers = {"solver": [CALL_12x34, "#### 408"], "verifier": ["#### 408", "#### 0"]}
    trajectories, ctx, engine = roll(tiny_tokenizer, make_ctx, answers)
    solver, verifier = trajectories
    r = ctx.renderer
    tools = ctx.toolbox.session("x", ROW.extra_info.tools_kwargs).schemas()
    assert (solver.role, solver.group_id, solver.reward) == ("solver", "0:r0@solver", 1.0)
    assert (verifier.role, verifier.group_id, verifier.reward) == ("verifier", "0:r0@verifier", 1.0)
    # the solver: its own conversation, exactly as the template renders it, tool result masked
    assert solver.prompt_ids + solver.response_ids == r.template_ids(solver.messages, tools, add_generation_prompt=False)
    assert [x.role for x in solver.turns] == ["assistant", "tool", "assistant"]
    assert solver.messages[-1] == {"role": "assistant", "content": "#### 408"}
    # the verifier: the row's messages as the solver's, its own working, the solver's answer told
    # as a user message (masked), then its verdict
    told = [{"role": "assistant", "content": "#### 408"}, {"role": "user", "content": "Answer: 408"}]
    assert verifier.messages == ROW.messages() + told + [{"role": "assistant", "content": "#### 0"}]
    assert verifier.prompt_ids == r.prompt_ids(ROW.messages(), tools) == solver.prompt_ids
    own = tiny_tokenizer.encode("#### 408", add_special_tokens=False) + [r.eos_id]
    verdict = tiny_tokenizer.encode("#### 0", add_special_tokens=False) + [r.eos_id]
    before_verdict = r.prompt_ids(ROW.messages() + told, tools)
    shown = before_verdict[len(verifier.prompt_ids) + len(own):]  # separator, the told message, the next turn's start
    assert verifier.response_ids == own + shown + verdict + r.separator_ids
    assert verifier.response_mask == [1] * len(own) + [0] * len(shown) + [1] * len(verdict) + [0] * len(r.separator_ids)
    assert verifier.prompt_ids + verifier.response_ids == r.template_ids(verifier.messages, tools, add_generation_prompt=False)
    assert [x.role for x in verifier.turns] == ["assistant", "user", "assistant"]
    # the engine saw each role's own context, in its own session, with its own seed
    by_session = [(q.session_id, q.input_ids) for q in engine.requests]
    assert [s for s, _ in by_session] == ["r0#0@solver", "r0#0@solver", "r0#0@verifier", "r0#0@verifier"]
    assert by_session[2][1] == verifier.prompt_ids and by_session[3][1] == before_verdict
    assert engine.requests[0].sampling.seed != engine.requests[2].sampling.seed
    assert verifier.reward_info["role_rewards"] == {"solver": 1.0, "verifier": 1.0}


def test_a_wrong_answer_and_the_verdicts_on_it_are_rewarded_by_role(tiny_tokenizer, make_ctx):
    answers = {"solver/0": ["#### 407"], "solver/1": ["#### 407"], "verifier/0": ["#### 407", "#### 0"],
               "verifier/1": ["#### 408", "#### 1"]}
    trajectories, _, _ = roll(tiny_tokenizer, make_ctx, answers, n=2)
    assert [(t.role, t.sample_index, t.reward) for t in trajectories] == [
        ("solver", 0, 0.0), ("verifier", 0, 0.0), ("solver", 1, 0.0), ("verifier", 1, 1.0)]
    sampled = {text: len(tiny_tokenizer.encode(text, add_special_tokens=False)) + 1
               for text in ["#### 407", "#### 408", "#### 1", "#### 0"]}
    assert role_metrics(trajectories) == {
        "role/solver/reward": 0.0, "role/solver/tokens": sampled["#### 407"], "role/solver/tool_calls": 0.0,
        "role/verifier/reward": 0.5,
        "role/verifier/tokens": (sampled["#### 407"] + sampled["#### 0"] + sampled["#### 408"] + sampled["#### 1"]) / 2,
        "role/verifier/tool_calls": 0.0}


def test_a_frozen_verifier_is_scripted_and_has_no_trajectory(tiny_tokenizer, make_ctx):
    trajectories, _, engine = roll(tiny_tokenizer, make_ctx, {"solver": ["#### 407"]}, agent={"roles": {"verifier": "frozen"}})
    [solver] = trajectories
    assert (solver.role, solver.reward, solver.reward_info["role_rewards"]) == ("solver", 0.0, {"solver": 0.0, "verifier": 1.0})
    assert {q.session_id for q in engine.requests} == {"r0#0@solver"}  # the policy never spoke for the verifier


def test_role_policies_name_the_config_key():
    declared = {"solver": "shared", "verifier": "shared"}
    with pytest.raises(ConfigError, match=r"agent\.roles\.judge.*loop 'solver_verifier' has no role 'judge'"):
        role_policies(declared, {"judge": "frozen"}, loop="solver_verifier")
    with pytest.raises(ConfigError, match=r"agent\.roles\.verifier.*declares role 'verifier' trained: set agent\.roles\.verifier=trained"):
        role_policies({"solver": "shared", "verifier": "trained"}, {}, loop="solver_verifier")
    with pytest.raises(ConfigError, match=r"agent\.roles.*no role is shared: the main policy would train on nothing"):
        role_policies(declared, {"verifier": "trained", "solver": "frozen"}, loop="solver_verifier")
    assert role_policies(declared, {"verifier": "trained"}, loop="x") == {"solver": "shared", "verifier": "trained"}
    with pytest.raises(ConfigError, match=r"agent\.roles.*every role is frozen"):
        role_policies(declared, {"verifier": "frozen", "solver": "frozen"}, loop="solver_verifier")
    assert role_policies(declared, {"verifier": "frozen"}, loop="x") == {"solver": "shared", "verifier": "frozen"}


def test_a_reward_function_may_answer_by_role(tiny_tokenizer, make_ctx, monkeypatch):
    from agentrl_agent_loops import solver_verifier

    async def no_own_rewards(self, game):  # the loop leaves the rewards to the reward function
        await game.turn("solver")
        await game.turn("verifier")
        return "stop"

    monkeypatch.setattr(solver_verifier.SolverVerifierLoop, "play_roles", no_own_rewards)
    seen = []

    def by_role(data_source, solution, ground_truth, extra_info):
        seen.append((solution, extra_info["transcript"]))
        return {"solver": 0.25, "verifier": {"score": 0.75}}

    monkeypatch.setattr("agentrl.agent.runner.RewardTable.__call__", lambda self, source: by_role)
    trajectories, _, _ = roll(tiny_tokenizer, make_ctx, {"solver": ["#### 408"], "verifier": ["#### 0"]})
    assert [(t.role, t.reward) for t in trajectories] == [("solver", 0.25), ("verifier", 0.75)]
    assert seen == [("#### 0", [{"role": "solver", "content": "#### 408"}, {"role": "verifier", "content": "#### 0"}])]


def test_verdicts_are_read_from_the_end():
    texts = ["#### 0", "so #### 1 \n", "#### 0 then", "#### 10", "0", "#### -3000", "#### 0.5", "#### -0"]
    assert [verdict_of(t) for t in texts] == [True, False, None, False, None, False, None, True]


def test_the_store_keeps_the_role_and_reads_older_shards_without_one(tiny_tokenizer, make_ctx, tmp_path):
    trajectories, _, _ = roll(tiny_tokenizer, make_ctx, {"solver": ["#### 408"], "verifier": ["#### 408", "#### 1"]})
    store = RolloutStore(tmp_path)
    path = store.write_step(1, trajectories)
    assert list(store.iter_trajectories()) == trajectories
    older = pq.read_table(path).drop_columns(["role"]).replace_schema_metadata({"agentrl_schema_version": "6"})
    pq.write_table(older, path)
    assert list(store.iter_trajectories()) == [dataclasses.replace(t, role=None) for t in trajectories]


def test_a_trained_role_is_refused_where_no_engine_serves_its_policy(tiny_tokenizer, make_ctx):
    from agentrl.config import compose, validate_config

    cfg = validate_config(compose("train", ["data=solver_verifier", "agent.roles.verifier=trained"]))
    assert cfg.agent.roles == {"verifier": "trained"}
    with pytest.raises(ConfigError) as info:  # agentrl rollout, replay rerun: one engine, the main policy's
        make_ctx(ScriptedEngine(tiny_tokenizer, {}), agent={"roles": {"verifier": "trained"}})
    assert info.value.problems == [("agent.roles.verifier", "trained: no engine here serves the role's own policy (agentrl "
                                    "train builds one; elsewhere use shared or frozen, docs/roles.md)")]
    cfg = validate_config(compose("train", ["data=solver_verifier", "agent.roles.verifier=frozen"]))
    assert (cfg.data.task, cfg.agent.roles) == ("solver_verifier", {"verifier": "frozen"})


def test_the_interaction_answers_a_role_and_rewards_turns_and_episodes_by_role(tiny_tokenizer, make_ctx):
    from agentrl.agent.interaction import Interaction, InteractionResponse
    from agentrl.agent.roles import RolesLoop

    class Judge(Interaction):
        calls: list = []

        async def generate_response(self, instance_id, messages):
            self.calls.append(messages[-1]["content"])
            if len(self.calls) == 1:  # the solver's first answer: another try, half a point for it
                return InteractionResponse(done=False, text="Try again.", reward={"solver": 0.5, "verifier": 2.0})
            return InteractionResponse(done=True, text="", reward={"verifier": 1.0, "solver": 0.25})

        async def calculate_score(self, instance_id):
            return {"solver": 1.0, "verifier": 0.0}

        async def finalize(self, instance_id):
            self.calls.append("finalized")

    class Play(RolesLoop):
        name = "play"
        roles = {"solver": "shared", "verifier": "shared"}

        async def play_roles(self, game):
            await game.ask("solver", await game.turn("solver"))
            await game.turn("solver")
            await game.ask("verifier", await game.turn("verifier"))

    engine = ScriptedEngine(tiny_tokenizer, script_by_role({"solver": ["#### 407", "#### 408"], "verifier": ["#### 1"]}))
    ctx = make_ctx(engine)
    ctx.interactions._instances["judge"] = Judge()
    row = make_row(agent="play", interaction_kwargs={"name": "judge"})
    solver, verifier = asyncio.run(Play().run(row, ctx, row_id="r0", group_id="g"))
    assert Judge.calls == ["#### 407", "#### 1", "finalized"]
    # turn rewards by role: the verifier had no turn when the first reply came, so its 2.0 went nowhere
    assert [(t.role, t.reward) for t in solver.turns] == [("assistant", 0.5), ("user", None), ("assistant", 0.25)]
    assert [(t.role, t.reward) for t in verifier.turns] == [("assistant", 1.0)]
    assert solver.messages[3:] == [{"role": "user", "content": "Try again."}, {"role": "assistant", "content": "#### 408"}]
    # the verifier saw both of the solver's answers, in its prompt, as user messages
    assert verifier.messages == row.messages() + [{"role": "user", "content": "#### 407"}, {"role": "user", "content": "#### 408"},
                                                  {"role": "assistant", "content": "#### 1"}]
    assert verifier.prompt_ids == ctx.renderer.prompt_ids(verifier.messages[:-1], ctx.toolbox.session("x", row.extra_info.tools_kwargs).schemas())
    assert [(t.role, t.reward, t.finish_reason) for t in (solver, verifier)] == [
        ("solver", 1.0, "interaction_done"), ("verifier", 0.0, "interaction_done")]


def test_the_run_report_plots_each_roles_reward():
    from agentrl.report import PLOTS

    [plot] = [p for p in PLOTS if p.title.startswith("reward by role")]
    keys = ["role/solver/reward", "role/solver/tokens", "val/role/verifier/reward", "reward/mean", "val/role/solver/tool_calls"]
    assert plot.series_keys(keys) == ["role/solver/reward", "val/role/verifier/reward"]


def test_asynchronous_rollouts_return_a_rows_group_whole_with_every_roles_trajectories(tiny_tokenizer, make_ctx):
    from agentrl.agent.async_rollout import BackgroundRollout

    engine = ScriptedEngine(tiny_tokenizer, script_by_role({"solver": ["#### 408"], "verifier": ["#### 408", "#### 1"]}))
    background = BackgroundRollout(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")))
    try:
        ids = background.submit([("r0", ROW), ("r1", ROW)], n=3, seed=0, group_prefix="train0/", version=2)
        groups = []
        while len(groups) < 2:
            groups += background.finished(wait_s=10)
        assert background.in_flight == 0
        by_id = {g.group_id: g for g in groups}
        assert sorted(by_id) == ids == ["train0/0:r0", "train0/1:r1"]
        for g in groups:
            assert [(t.sample_index, t.role, t.group_id, t.policy_version) for t in g.trajectories] == [
                (k, role, f"{g.group_id}@{role}", 2) for k in range(3) for role in ("solver", "verifier")]
    finally:
        background.close()


def test_the_run_summary_and_the_reports_headline_give_each_roles_held_out_reward():
    import re

    from agentrl.report import render_report
    from agentrl.trainer.run import _by_source

    validation = {"val/success_rate": 0.5, "val/role/solver/reward": 1.0, "val/role/solver/tokens": 35.0,
                  "val/role/verifier/reward": 0.0625}
    assert _by_source(validation, "after") == {"heldout_by_role_after": {"solver": 1.0, "verifier": 0.0625}}
    summary = {"heldout_success_before": 0.0, "heldout_success_after": 0.5,
               **_by_source({"val/role/solver/reward": 0.0, "val/role/verifier/reward": 0.5}, "before"), **_by_source(validation, "after")}
    page = render_report([], [], "run", summary=summary)
    rows = re.findall(r'<tr><th scope="row">([^<]*)</th><td>([^<]*)</td><td class="after">([^<]*)</td><td>([^<]*)</td></tr>', page)
    assert rows == [("held-out success", "0.0%", "50.0%", "+50.0 points"),
                    ("held-out reward · role solver", "0.0%", "100.0%", "+100.0 points"),
                    ("held-out reward · role verifier", "50.0%", "6.2%", "-43.8 points")]

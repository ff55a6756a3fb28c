"""What each role's loss contains, pinned by hand: a scripted two-role episode (solver and
verifier of one shared policy, agent_loops/solver_verifier.py) through the runner and the
training step, two samples of one row. Both roles' tokens reach one update, each row with its
own role's tokens, mask and GRPO advantage, grouped per role and prompt."""

from __future__ import annotations

import asyncio
import functools
import math

import torch
from torch.testing import assert_close

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import TrainConfig
from agentrl.trainer.step import Groups, LocalGroup, TrainingStep
from tests.agent.agent_helpers import make_row

# sample 0: a right answer judged right (the verifier's own working came to it too); sample 1: a wrong
# answer judged wrong. Solver rewards [1, 0], verifier rewards [1, 1]: one pooled group of four would
# give the verifier's samples advantages too, per-role groups give the verifier none (a group all alike).
ANSWERS = {("solver", "0"): ["#### 408"], ("solver", "1"): ["#### 407"],
           ("verifier", "0"): ["#### 408", "#### 0"], ("verifier", "1"): ["#### 408", "#### 1"]}
# the agent program below asks its verifier once, for the verdict alone
PROGRAM_ANSWERS = {**ANSWERS, ("verifier", "0"): ["#### 0"], ("verifier", "1"): ["#### 1"]}


def script(row_id, index, request, answers=ANSWERS):
    sample, role = request.session_id.rsplit("#", 1)[1].split("@")
    return answers[(role, sample)][index]


class RecordingActor:
    """A worker that records the mini-batches the update gets (the loss's rows) and returns the
    batch's own logprobs as the policy's."""

    def __init__(self):
        self.updates = []

    def compute_logprobs(self, batch, micro):
        return batch.engine_logprobs.clone(), torch.zeros_like(batch.engine_logprobs)

    def update(self, minis, denominators, **kwargs):
        self.updates.extend(minis)
        return {"actor/loss": 0.0}


def test_both_roles_train_in_one_loss_each_with_its_own_role_group_advantage(tiny_tokenizer):
    cfg = TrainConfig.model_validate({"data": {"train_batch_size": 2, "max_response_length": 64},
                                      "actor": {"ppo_mini_batch_size": 1}, "rollout": {"n": 2},
                                      "algorithm": {"adv_estimator": "grpo"}})
    engine = ScriptedEngine(tiny_tokenizer, script)
    ctx = build_context(engine, tiny_tokenizer, RolloutSetup.from_config(cfg), tool_names=["calculator"])
    runner = RolloutRunner(ctx, LoopTable("tool_agent"))
    trajectories = asyncio.run(runner.run([("r0", make_row(agent="solver_verifier"))], n=2))
    assert [(t.role, t.sample_index, t.reward) for t in trajectories] == [
        ("solver", 0, 1.0), ("verifier", 0, 1.0), ("solver", 1, 0.0), ("verifier", 1, 1.0)]

    actor = RecordingActor()
    result = TrainingStep(cfg, Groups(actor=LocalGroup(actor)), pad_token_id=0).online(trajectories, step=0)
    # group size n × roles = 4 rows: the row's whole episode set is one mini-batch, one loss
    [mini] = actor.updates
    assert len(mini) == 4
    eot = ctx.renderer.eos_id
    sep = ctx.renderer.separator_ids
    grpo = 0.5 / (math.sqrt(0.5) + 1e-6)  # (r - mean) / (std + eps), std unbiased over [1, 0]
    sampled = {text: tiny_tokenizer.encode(text, add_special_tokens=False) + [eot] for text in ["#### 408", "#### 407"]}
    by_key = {(t.role, t.sample_index): t for t in trajectories}
    expected = {  # role, sample -> (response ids, its mask, advantage on each sampled token)
        ("solver", 0): (sampled["#### 408"] + sep, [1] * len(sampled["#### 408"]) + [0] * len(sep), grpo),
        ("solver", 1): (sampled["#### 407"] + sep, [1] * len(sampled["#### 407"]) + [0] * len(sep), -grpo),
        # the verifier's working, the answer told (masked) and its verdict (test_roles pins the tokens)
        ("verifier", 0): (by_key["verifier", 0].response_ids, by_key["verifier", 0].response_mask, 0.0),
        ("verifier", 1): (by_key["verifier", 1].response_ids, by_key["verifier", 1].response_mask, 0.0),
    }
    assert by_key["verifier", 0].response_ids[: len(sampled["#### 408"])] == sampled["#### 408"]
    prompts = {(t.role, t.sample_index): t.prompt_ids for t in trajectories}
    rows = {}
    for i in range(len(mini)):
        width = mini.response_mask.shape[1]
        mask = mini.response_mask[i]
        n_resp = int(mini.attention_mask[i, -width:].sum())
        response = mini.input_ids[i, -width:][:n_resp].tolist()
        prompt = mini.input_ids[i, :-width][mini.attention_mask[i, :-width].bool()].tolist()
        key = next(k for k, p in prompts.items() if p == prompt and response == expected[k][0])
        rows[key] = i
        ids, response_mask, adv = expected[key]
        assert mask[:n_resp].tolist() == response_mask  # the role's own sampled tokens only
        sampled_at = mask[:n_resp].bool()
        assert_close(mini.advantages[i, :n_resp][sampled_at], torch.full((sum(response_mask),), adv), atol=1e-5, rtol=0)
        assert (mini.advantages[i, :n_resp][~sampled_at] == 0).all() and (mini.advantages[i, n_resp:] == 0).all()
    assert sorted(rows) == sorted(expected)
    # the verifier is told the solver's answer of the same sample, as a user message after its working
    told = {t.sample_index: t.messages[-2] for t in trajectories if t.role == "verifier"}
    assert told == {0: {"role": "user", "content": "Answer: 408"}, 1: {"role": "user", "content": "Answer: 407"}}
    assert result.metrics["role/solver/reward"] == 0.5 and result.metrics["role/verifier/reward"] == 1.0
    assert result.metrics["role/solver/tokens"] == (len(sampled["#### 408"]) + len(sampled["#### 407"])) / 2


def test_an_agent_program_with_roles_trains_each_role_with_its_own_advantage(tiny_tokenizer):
    """The same episode written as an agent program with the plain openai client: the request's
    model field names the role; the step gets each role's own tokens with its role group's advantage."""
    import openai

    from agentrl.agent.program import AgentResult
    from tests.agent.agent_helpers import loop_with

    def program(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        answer = client.chat.completions.create(model="solver", messages=task.messages).choices[0].message.content
        verdict = client.chat.completions.create(model="verifier", messages=[
            {"role": "user", "content": f"Check: {answer}"}]).choices[0].message.content
        right = answer == "#### 408"
        return AgentResult(final_answer=answer, reward={"solver": float(right), "verifier": float((verdict == "#### 0") == right)})

    cfg = TrainConfig.model_validate({"data": {"train_batch_size": 2, "max_response_length": 64},
                                      "actor": {"ppo_mini_batch_size": 1}, "rollout": {"n": 2},
                                      "agent": {"roles": {"solver": "shared", "verifier": "shared"}}})
    engine = ScriptedEngine(tiny_tokenizer, functools.partial(script, answers=PROGRAM_ANSWERS))
    ctx = build_context(engine, tiny_tokenizer, RolloutSetup.from_config(cfg), tool_names=[])
    loops = LoopTable("openai_agent")
    loops._loops["openai_agent"] = loop_with(program)  # the test's program for every row
    trajectories = asyncio.run(RolloutRunner(ctx, loops).run([("r0", make_row(agent="openai_agent"))], n=2))
    assert [(t.role, t.group_id, t.reward) for t in trajectories] == [
        ("solver", "0:r0@solver", 1.0), ("verifier", "0:r0@verifier", 1.0),
        ("solver", "0:r0@solver", 0.0), ("verifier", "0:r0@verifier", 1.0)]
    assert {t.token_versions[0] for t in trajectories} == {0}  # each role's tokens carry the policy's weight version

    actor = RecordingActor()
    TrainingStep(cfg, Groups(actor=LocalGroup(actor)), pad_token_id=0).online(trajectories, step=0)
    [mini] = actor.updates
    grpo = 0.5 / (math.sqrt(0.5) + 1e-6)
    width = mini.response_mask.shape[1]
    got = {}
    for i in range(len(mini)):
        n_sampled = int(mini.response_mask[i].sum())
        response = mini.input_ids[i, -width:][:n_sampled].tolist()
        got[tiny_tokenizer.decode(response[:-1])] = round(float(mini.advantages[i, 0]), 5)
        assert (mini.advantages[i, :n_sampled] == mini.advantages[i, 0]).all()
    assert got == {"#### 408": round(grpo, 5), "#### 407": round(-grpo, 5), "#### 1": 0.0, "#### 0": 0.0}

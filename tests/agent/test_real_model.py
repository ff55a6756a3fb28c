"""Each built-in loop against the real tiny model through the built-in engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agent_helpers import make_row
from transformers import AutoModelForCausalLM

from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.engines.builtin import BuiltinEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = BuiltinEngine(tiny_model_dir, max_batch_size=8, seed=0)
    yield engine
    engine.close()


@pytest.mark.parametrize("agent", ["single_turn", "tool_agent", "react"])
def test_loop_rolls_out_the_real_model_with_exact_logprobs(agent, engine, make_ctx, tiny_model_dir):
    ctx = make_ctx(engine, limits={"max_new_tokens": 12, "max_response_tokens": 48, "max_assistant_turns": 3})
    rows = [(f"r{i}", make_row(agent=agent)) for i in range(2)]
    trajectories = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows, n=2, seed=1))
    assert len(trajectories) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for t in trajectories:
        assert t.agent_name == agent and t.finish_reason in {"stop", "length", "response_budget", "max_assistant_turns"}
        assert 0 < len(t.response_ids) <= 48 and sum(t.response_mask) > 0
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
        reference = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(t.prompt_ids) :, None])[:, 0]
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        engine_lp = torch.tensor(t.logprobs)
        assert (engine_lp[mask] - reference[mask]).abs().max() < 1e-4
        assert (engine_lp[~mask] == 0).all()


def test_same_seed_repeats_the_rollout(engine, make_ctx):
    ctx = make_ctx(engine, limits={"max_new_tokens": 10, "max_response_tokens": 40})
    rows = [("r0", make_row())]
    first = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows, n=2, seed=5))
    second = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows, n=2, seed=5))
    assert [t.response_ids for t in first] == [t.response_ids for t in second]

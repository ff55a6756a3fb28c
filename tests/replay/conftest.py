"""Fixtures for replay tests: rows, a scripted rollout through the real agent layer, a store."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import DataConfig, RewardConfig, TrainConfig
from agentrl.data.row import Row
from replay_data import SCRIPT, make_row


@pytest.fixture
def make_ctx(tiny_tokenizer):
    def build(engine, *, limits: dict | None = None, reward: str = "gsm8k"):
        setup = RolloutSetup.from_config(TrainConfig(reward=RewardConfig(default=reward), data=DataConfig(max_response_length=512)))
        ctx = build_context(engine, tiny_tokenizer, setup, tool_names=["calculator"])
        if limits:
            ctx.limits = dataclasses.replace(ctx.limits, **limits)
        return ctx

    return build


@pytest.fixture
def rollout(tiny_tokenizer, make_ctx):
    """rollout(script, rows, n=1) -> trajectories, run by the real loops over ScriptedEngine."""

    def run(script, rows: list[tuple[str, Row]], *, n: int = 1, group_prefix: str = ""):
        engine = ScriptedEngine(tiny_tokenizer, script)
        runner = RolloutRunner(make_ctx(engine), LoopTable("tool_agent"))
        return asyncio.run(runner.run(rows, n=n, group_prefix=group_prefix))

    return run


@pytest.fixture
def sample_rows():
    """Three rows: a tool call then a right answer; a wrong answer retried through the gsm8k
    interaction; a ReAct episode."""
    return [
        ("r0", make_row(index=0)),
        ("r1", make_row("What is 7 + 5?", "12", index=1, data_source="other/src",
                        interaction_kwargs={"name": "gsm8k", "ground_truth": "12"})),
        ("r2", make_row("What is 2 * 3?", "6", agent="react", index=2)),
    ]


@pytest.fixture
def scripted_store(rollout, sample_rows, tmp_path):
    """A store of two training steps and one validation step from SCRIPT's rows (rows stored)."""
    from agentrl.data.rollout_store import RolloutStore

    store = RolloutStore(tmp_path / "rollouts")
    for step in range(2):
        store.write_step(step, rollout(SCRIPT, sample_rows, n=2, group_prefix=f"train{step}/"), rows=sample_rows)
    store.write_step(2, rollout(SCRIPT, sample_rows[:1]), split="val", rows=sample_rows[:1])
    return store

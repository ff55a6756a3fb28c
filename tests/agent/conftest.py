"""Fixtures for agent-layer tests: a context over the scripted engine and a one-call runner."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import AgentConfig, DataConfig, RewardConfig, TrainConfig
from agentrl.data.row import Row

@pytest.fixture
def make_ctx(tiny_tokenizer):
    def build(engine, *, tools=("calculator",), limits: dict | None = None, agent: dict | None = None, tokenizer=None,
              reward: dict | None = None):
        cfg = TrainConfig(agent=AgentConfig(**(agent or {})), data=DataConfig(max_response_length=512), reward=RewardConfig(**(reward or {})))
        setup = RolloutSetup.from_config(cfg)
        ctx = build_context(engine, tokenizer or tiny_tokenizer, setup, tool_names=list(tools))
        if limits:
            ctx.limits = dataclasses.replace(ctx.limits, **limits)
        return ctx

    return build


@pytest.fixture
def run_rows(tiny_tokenizer, make_ctx):
    """run_rows(script, rows, **ctx_kwargs) -> (trajectories, ctx, engine)."""

    def run(script, rows: list[tuple[str, Row]], *, n: int = 1, concurrency: int = 64, **ctx_kwargs):
        engine = ScriptedEngine(tiny_tokenizer, script)
        ctx = make_ctx(engine, **ctx_kwargs)
        runner = RolloutRunner(ctx, LoopTable("tool_agent"), max_concurrency=concurrency)
        trajectories = asyncio.run(runner.run(rows, n=n))
        return trajectories, ctx, engine, runner

    return run

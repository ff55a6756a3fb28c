"""BackgroundRollout: rollouts on a thread of their own, groups returned whole as they finish."""

from __future__ import annotations

import threading
import time

import pytest
from agent_helpers import make_row

from agentrl.agent.async_rollout import BackgroundRollout, RolloutLost
from agentrl.agent.runner import LoopTable, RolloutRunner
from agentrl.agent.scripted import ScriptedEngine


def test_groups_come_back_whole_with_their_dispatch_version_and_the_engine_versions_of_their_tokens(tiny_tokenizer, make_ctx):
    engine = ScriptedEngine(tiny_tokenizer, lambda row_id, i, request: "#### 408")
    background = BackgroundRollout(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")))
    try:
        ids = background.submit([("a", make_row()), ("b", make_row())], n=3, seed=0, group_prefix="train0/", version=0)
        assert ids == ["train0/0:a", "train0/1:b"]
        groups = []
        while len(groups) < 2:
            groups += background.finished(wait_s=10)
        engine.weight_version = 5  # a sync between dispatches: the next batch samples at version 5
        background.submit([("c", make_row())], n=2, seed=1, group_prefix="train1/", version=5)
        groups += background.finished(wait_s=10)
        assert background.in_flight == 0
        assert sorted(g.group_id for g in groups) == ["train0/0:a", "train0/1:b", "train1/0:c"]
        for g in groups:
            assert {t.group_id for t in g.trajectories} == {g.group_id}
            assert [t.sample_index for t in g.trajectories] == list(range(len(g.trajectories)))
        by_id = {g.group_id: g for g in groups}
        assert [len(by_id[k].trajectories) for k in sorted(by_id)] == [3, 3, 2]
        assert (by_id["train0/0:a"].dispatch_version, by_id["train0/0:a"].oldest_version) == (0, 0)
        assert (by_id["train1/0:c"].dispatch_version, by_id["train1/0:c"].oldest_version) == (5, 5)
        assert {t.policy_version for t in by_id["train1/0:c"].trajectories} == {5}
    finally:
        background.close()


def test_the_caller_is_free_while_groups_run_and_an_empty_wait_returns_after_its_time(tiny_tokenizer, make_ctx):
    release = threading.Event()

    class Slow(ScriptedEngine):
        async def generate(self, request):
            import asyncio

            while not release.is_set():
                await asyncio.sleep(0.01)
            return await super().generate(request)

    engine = Slow(tiny_tokenizer, lambda row_id, i, request: "#### 408")
    background = BackgroundRollout(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")))
    try:
        start = time.monotonic()
        background.submit([("a", make_row())], n=2, seed=0, group_prefix="train0/", version=0)
        assert time.monotonic() - start < 1.0  # submit does not wait for the rollout
        assert background.finished(wait_s=0.2) == [] and background.in_flight == 1
        release.set()
        groups = background.finished(wait_s=10)
        assert [len(g.trajectories) for g in groups] == [2]
    finally:
        background.close()


def test_a_batch_that_fails_as_a_whole_is_reported_to_the_taker(tiny_tokenizer, make_ctx):
    class Broken(RolloutRunner):
        async def run(self, *args, **kwargs):
            raise RuntimeError("the runner broke")

    background = BackgroundRollout(Broken(make_ctx(ScriptedEngine(tiny_tokenizer, {})), LoopTable("tool_agent")))
    try:
        background.submit([("a", make_row())], n=2, seed=0, group_prefix="train0/", version=0)
        with pytest.raises(RolloutLost, match="the trainer: a batch of rollouts failed as a whole: RuntimeError: the runner broke"):
            background.finished(wait_s=10)
        assert background.in_flight == 0
    finally:
        background.close()

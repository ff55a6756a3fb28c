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


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


def test_every_sampled_token_carries_the_weight_version_that_sampled_it_and_observed_tokens_none(tiny_tokenizer, make_ctx):
    """A sync between the two turns of an episode: the first turn's tokens are version 3, the
    second's version 4, the tool's observation -1; the group's oldest version is the first's."""
    import asyncio

    def script(row_id, i, request):
        engine.weight_version = 3 + i
        return [CALL, "#### 408"][i]

    engine = ScriptedEngine(tiny_tokenizer, script)
    [t] = asyncio.run(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")).run([("a", make_row())], n=1, seed=0))
    first, tool, second = [t.turns[k] for k in range(3)]
    assert (first.role, tool.role, second.role) == ("assistant", "tool", "assistant")
    assert t.token_versions[first.start : first.end] == [3] * first.length
    assert t.token_versions[tool.start : tool.end] == [-1] * tool.length
    assert t.token_versions[second.start : second.end] == [4] * second.length
    assert len(t.token_versions) == len(t.response_ids) and t.oldest_version == 3
    assert (t.metrics["weight_version_min"], t.metrics["weight_version_max"]) == (3.0, 4.0)


def test_an_engines_per_token_versions_reach_the_trajectory_token_for_token(tiny_tokenizer, make_ctx):
    """A request resumed across a weight update (partial rollouts) reports a version per token."""
    import asyncio
    import dataclasses

    class Resumed(ScriptedEngine):
        async def generate(self, request):
            result = await super().generate(request)
            n = len(result.output_ids)
            return dataclasses.replace(result, weight_version=9, output_versions=[7] * (n // 2) + [9] * (n - n // 2))

    engine = Resumed(tiny_tokenizer, lambda row_id, i, request: "#### 408")
    [t] = asyncio.run(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")).run([("a", make_row())], n=1, seed=0))
    n = t.turns[0].length
    assert t.token_versions[:n] == [7] * (n // 2) + [9] * (n - n // 2) and t.oldest_version == 7
    assert t.metrics["weight_version_min"] == 7.0


def test_each_batch_asks_the_engine_for_a_later_priority_than_the_batch_before(tiny_tokenizer, make_ctx):
    seen: dict[str, set[int]] = {}

    class Recording(ScriptedEngine):
        async def generate(self, request):
            seen.setdefault(request.rid.split("#")[0], set()).add(request.priority)
            return await super().generate(request)

    engine = Recording(tiny_tokenizer, lambda row_id, i, request: "#### 408")
    background = BackgroundRollout(RolloutRunner(make_ctx(engine), LoopTable("tool_agent")))
    try:
        for k, row_id in enumerate(["a", "b", "c"]):
            background.submit([(row_id, make_row())], n=2, seed=k, group_prefix=f"train{k}/", version=0)
        groups = []
        while len(groups) < 3:
            groups += background.finished(wait_s=10)
    finally:
        background.close()
    assert seen == {"a": {0}, "b": {1}, "c": {2}}  # the oldest batch first in the built-in engine's queue

"""An engine server killed mid-rollout: every trajectory comes back (finished on the other server
or ended with ``engine_error`` recorded), and the batch completes."""

from __future__ import annotations

import asyncio
import os
import signal

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import AgentConfig, DataConfig, RolloutConfig, TrainConfig
from agentrl.data.dataset import rows_from_dicts
from agentrl.engines.launch import launch_servers, serve_specs
from agentrl.engines.sglang import SGLangEngine
from agentrl_data_prep.tasks import generate


def test_rollout_survives_a_server_killed_mid_flight(tiny_model_dir, tiny_tokenizer, tmp_path):
    servers = launch_servers(serve_specs(tiny_model_dir, num_servers=2), ready_timeout_s=120, log_dir=tmp_path)
    a, b = servers.servers
    engine = SGLangEngine([a.url, b.url], api_key=servers.api_key, max_retries=2, backoff_s=0.05, probe_interval_s=0.2)
    setup = RolloutSetup.from_config(TrainConfig(
        agent=AgentConfig(max_assistant_turns=3), rollout=RolloutConfig(max_new_tokens=24), data=DataConfig(max_response_length=96),
    ))  # fmt: skip
    ctx = build_context(engine, tiny_tokenizer, setup)
    rows = rows_from_dicts(generate("arith", 12, seed=3))

    done = []

    def kill_a_after_two(trajectory):
        done.append(trajectory)
        if len(done) == 2:  # mid-flight: 22 trajectories still running or waiting
            os.kill(a.process.pid, signal.SIGKILL)

    async def main():
        try:
            runner = RolloutRunner(ctx, LoopTable("tool_agent"), max_concurrency=6)
            return await asyncio.wait_for(runner.run(rows, n=2, seed=0, on_done=kill_a_after_two), 240)
        finally:
            await engine.aclose()

    try:
        trajectories = asyncio.run(main())
        assert len(trajectories) == 24  # none missing
        assert {(t.row_id, t.sample_index) for t in trajectories} == {(uid, s) for uid, _ in rows for s in range(2)}
        for t in trajectories:
            assert t.finish_reason != "loop_error", t.reward_info
            assert len(t.response_ids) == len(t.response_mask) == len(t.logprobs)
            if t.finish_reason == "engine_error":
                assert t.reward_info["error"]
        assert sum(t.finish_reason != "engine_error" for t in trajectories) >= 12  # the survivor took over
        assert not engine.servers[0].healthy and engine.servers[1].healthy
    finally:
        servers.stop()

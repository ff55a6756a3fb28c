"""The SGLang client and server manager against `agentrl serve` over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from agentrl.engines.base import FinishReason, GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.guard import auth_headers
from agentrl.engines.launch import free_port
from agentrl.engines.sglang import SGLangClient, SGLangEngine
from agentrl.errors import EngineUnavailable
from enginetest import load_reference, reference_greedy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kwargs)


async def served_count(server) -> int:
    async with httpx.AsyncClient(headers=auth_headers(server.api_key)) as http:
        return (await http.get(f"{server.url}/get_server_info")).json()["num_requests_served"]


async def served_counts(servers) -> tuple[int, ...]:
    return tuple([await served_count(s) for s in servers])


async def test_generate_over_http_equals_the_in_process_engine(server_pair, model_dir):
    requests = [
        GenerateRequest(PROMPT, greedy(12)),
        GenerateRequest(PROMPT[:4], SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.8, seed=3)),
        GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=12, temperature=1.2, top_k=10, seed=4, stop_token_ids=(17,))),
    ]
    engine = BuiltinEngine(model_dir)
    try:
        local = [await engine.generate(r) for r in requests]
    finally:
        engine.close()
    client = SGLangClient(server_pair[0].url, api_key=server_pair[0].api_key)
    try:
        remote = [await client.generate(r) for r in requests]
    finally:
        await client.aclose()
    for mine, theirs in zip(local, remote):
        assert theirs.output_ids == mine.output_ids
        assert theirs.logprobs == pytest.approx(mine.logprobs, abs=1e-5)
        assert (theirs.finish_reason, theirs.matched_stop, theirs.prompt_tokens) == (mine.finish_reason, mine.matched_stop, mine.prompt_tokens)


async def test_abort_over_http_returns_the_partial_output(server_pair):
    server = server_pair[0]
    client = SGLangClient(server.url, api_key=server.api_key)
    try:
        before = await served_count(server)
        running = asyncio.create_task(client.generate(GenerateRequest(PROMPT, greedy(500), rid="running")))
        while await served_count(server) == before:  # the request reached the server
            await asyncio.sleep(0.01)
        await client.abort("running")
        stopped = await running
        assert stopped.finish_reason is FinishReason.ABORT
        assert 0 < len(stopped.output_ids) < 500 and len(stopped.logprobs) == len(stopped.output_ids)
    finally:
        await client.aclose()


async def test_bad_request_is_a_400_naming_the_field(server_pair):
    url = server_pair[0].url
    async with httpx.AsyncClient(headers=auth_headers(server_pair[0].api_key)) as http:
        reply = await http.post(f"{url}/generate", json={"input_ids": [1, 2, 999], "sampling_params": {"max_new_tokens": 2}})
        assert reply.status_code == 400 and "input_ids[2] = 999 is outside the vocabulary" in reply.text
        reply = await http.post(f"{url}/generate", json={"input_ids": [[1], [2]], "sampling_params": [{"top_k": 0}, {}]})
        assert reply.status_code == 400 and "sampling_params[0]: top_k must be -1 (off) or >= 1" in reply.text
        reply = await http.post(f"{url}/generate", json={"text": "hello"})
        assert reply.status_code == 400 and "send token ids in input_ids" in reply.text


async def test_sessions_stick_to_one_server_and_requests_balance_across_two(server_pair):
    engine = SGLangEngine([s.url for s in server_pair], api_key=server_pair[0].api_key)
    try:
        await engine.generate(GenerateRequest([0], greedy(1)))  # settle any retained prefixes
        start = await served_counts(server_pair)
        # Balancing: 8 concurrent requests split 4/4 by outstanding count.
        await asyncio.gather(*(engine.generate(GenerateRequest(PROMPT, greedy(30))) for _ in range(8)))
        after = await served_counts(server_pair)
        assert (after[0] - start[0], after[1] - start[1]) == (4, 4)
        # Stickiness: every turn of a session lands on the server of its first turn, whose prefix
        # cache then holds the history (cached_tokens); the sessions spread over both servers.
        histories = {f"s{i}": [10 + i, 20 + i, 30 + i] for i in range(4)}
        for turn_index in range(3):
            turns = await asyncio.gather(
                *(engine.generate(GenerateRequest(h, greedy(4), session_id=sid)) for sid, h in histories.items())
            )
            for (sid, history), turn in zip(histories.items(), turns):
                if turn_index > 0:
                    assert turn.cached_tokens == len(history) - 2, sid  # all but the last sample and the observation
                history.extend(turn.output_ids + [99])
        end = await served_counts(server_pair)
        assert (end[0] - after[0], end[1] - after[1]) == (6, 6)
    finally:
        await engine.aclose()


async def test_update_weights_from_disk_reaches_every_server(server_pair, model_dir, other_model_dir):
    engine = SGLangEngine([s.url for s in server_pair], api_key=server_pair[0].api_key)
    expected = reference_greedy(load_reference(other_model_dir), PROMPT, 8)
    try:
        await engine.update_weights(path=str(other_model_dir))
        start = await served_counts(server_pair)
        results = await asyncio.gather(*(engine.generate(GenerateRequest(PROMPT, greedy(8))) for _ in range(4)))
        assert all(r.output_ids == expected and r.weight_version == 1 for r in results)
        end = await served_counts(server_pair)
        assert (end[0] - start[0], end[1] - start[1]) == (2, 2)
    finally:
        await engine.update_weights(path=str(model_dir), version=0)
        await engine.aclose()


async def test_distributed_weight_update_broadcasts_over_gloo(server_pair, model_dir, other_model_dir):
    engine = SGLangEngine([s.url for s in server_pair], api_key=server_pair[0].api_key)
    new_model = load_reference(other_model_dir)
    expected = reference_greedy(new_model, PROMPT, 8)
    try:
        await engine.init_weights_update_group(master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60)
        tensors = [(k, v) for k, v in new_model.state_dict().items() if k != "lm_head.weight"]  # tied: sent once
        await engine.update_weights_from_distributed(tensors, version=5, bucket_bytes=64 * 1024)  # several buckets
        results = await asyncio.gather(*(engine.generate(GenerateRequest(PROMPT, greedy(8))) for _ in range(2)))
        assert all(r.output_ids == expected and r.weight_version == 5 for r in results)
    finally:
        await engine.update_weights(path=str(model_dir), version=0)
        await engine.aclose()


async def test_client_retries_until_a_killed_server_is_back(serve_factory, model_dir):
    [server] = serve_factory()
    expected = reference_greedy(load_reference(model_dir), PROMPT, 6)
    server.stop(grace_s=0.5)
    client = SGLangClient(server.url, api_key=server.api_key, max_retries=60, backoff_s=0.1, max_backoff_s=0.5)
    try:
        pending = asyncio.create_task(client.generate(GenerateRequest(PROMPT, greedy(6))))
        await asyncio.sleep(0.3)  # let the first attempts fail
        assert not pending.done()
        restart = threading.Thread(target=serve_factory, kwargs={"ports": [server.spec.port]})
        restart.start()
        result = await pending
        restart.join()
        assert result.output_ids == expected
    finally:
        await client.aclose()


async def test_a_dead_server_leaves_rotation_and_rejoins_when_it_is_back(serve_factory, model_dir):
    a, b = serve_factory(2)
    engine = SGLangEngine([a.url, b.url], api_key=a.api_key, max_retries=0, probe_interval_s=0.1)
    expected = reference_greedy(load_reference(model_dir), PROMPT, 5)
    try:
        a.stop(grace_s=0.5)
        results = await asyncio.gather(*(engine.generate(GenerateRequest(PROMPT, greedy(5))) for _ in range(4)))
        assert all(r.output_ids == expected for r in results)  # the request sent to a was retried on b
        assert [s.healthy for s in engine.servers] == [False, True]
        assert await served_count(b) == 4
        serve_factory(ports=[a.spec.port])
        for _ in range(200):  # each generate lets the engine probe the dead server in the background
            await engine.generate(GenerateRequest(PROMPT, greedy(1)))
            if engine.servers[0].healthy:
                break
            await asyncio.sleep(0.05)
        assert [s.healthy for s in engine.servers] == [True, True]
    finally:
        await engine.aclose()


async def test_client_gives_up_with_engine_unavailable_when_nothing_listens():
    client = SGLangClient(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    try:
        with pytest.raises(EngineUnavailable) as info:
            await client.generate(GenerateRequest(PROMPT, greedy(2)))
        assert isinstance(info.value.__cause__, httpx.ConnectError)
    finally:
        await client.aclose()


async def test_no_live_server_raises_engine_unavailable():
    engine = SGLangEngine([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], max_retries=0)
    try:
        with pytest.raises(EngineUnavailable, match="no healthy SGLang server"):
            await engine.generate(GenerateRequest(PROMPT, greedy(2)))
        assert [s.healthy for s in engine.servers] == [False, False]
    finally:
        await engine.aclose()

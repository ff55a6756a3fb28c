"""The SGLang client's wire format, retries and error mapping, against in-process fake servers."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from agentrl.engines import sglang as sglang_module
from agentrl.engines.base import FinishReason, GenerateRequest, SamplingParams
from agentrl.engines.sglang import SGLangClient, SGLangEngine, map_http_error, parse_generate_response
from agentrl.errors import EngineError, EngineTimeout, EngineUnavailable

pytestmark = pytest.mark.anyio


def answer(output_ids, logprobs, finish, version="3", cached=0):
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": "r",
            "finish_reason": finish,
            "prompt_tokens": 2,
            "completion_tokens": len(output_ids),
            "cached_tokens": cached,
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
        },
    }


class FakeServers:
    """An httpx transport that routes by host and records every request body."""

    def __init__(self, handlers):
        self.handlers = handlers  # host -> callable(request, body) -> httpx.Response
        self.calls: list[tuple[str, str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.url.host, request.url.path, body))
        return self.handlers[request.url.host](request, body)


def transport(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


async def test_every_sampling_parameter_is_sent_explicitly():
    fake = FakeServers({"a": lambda req, body: httpx.Response(200, json=answer([4, 9], [-0.5, -1.5], {"type": "stop", "matched": 9}))})
    client = SGLangClient("http://a", transport=transport(fake))
    request = GenerateRequest([1, 2], SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=20, stop_token_ids=(9,), stop=("\n\n\n", "END"), seed=5), rid="x")
    result = await client.generate(request)
    [(_, path, body)] = fake.calls
    assert path == "/generate"
    assert body == {
        "input_ids": [1, 2],
        "sampling_params": {
            "max_new_tokens": 7, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
            "n": 1, "stop_token_ids": [9], "stop": ["\n\n\n", "END"], "ignore_eos": False, "skip_special_tokens": False,
            "no_stop_trim": True, "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "x",
        "stream": False,
    }  # fmt: skip
    assert (result.output_ids, result.logprobs) == ([4, 9], [-0.5, -1.5])
    assert (result.finish_reason, result.matched_stop, result.weight_version) == (FinishReason.STOP, 9, 3)


@pytest.mark.parametrize(
    ("finish", "reason"),
    [({"type": "length", "length": 2}, FinishReason.LENGTH), ({"type": "abort", "message": "Abort"}, FinishReason.ABORT)],
)
def test_finish_reasons_map_to_the_enum(finish, reason):
    result = parse_generate_response(answer([4, 5], [-1.0, -2.0], finish))
    assert result.finish_reason is reason and result.matched_stop is None


def test_a_stop_string_match_comes_back_as_the_string():
    result = parse_generate_response(answer([4, 5], [-1.0, -2.0], {"type": "stop", "matched": "END"}))
    assert (result.output_ids, result.finish_reason, result.matched_stop) == ([4, 5], FinishReason.STOP, "END")


def test_a_non_numeric_weight_version_falls_back_to_the_engines_own():
    assert parse_generate_response(answer([1], [-1.0], {"type": "length", "length": 1}, version="default"), fallback_version=4).weight_version == 4


def test_logprobs_for_other_tokens_than_the_output_are_an_error():
    body = answer([1, 2], [-1.0, -1.0], {"type": "length", "length": 2})
    body["meta_info"]["output_token_logprobs"][1][1] = 3
    with pytest.raises(EngineError, match="logprobs for 2 tokens"):
        parse_generate_response(body)


async def test_5xx_is_retried_with_backoff_and_4xx_is_not():
    attempts = {"n": 0}

    def flaky(req, body):
        attempts["n"] += 1
        if attempts["n"] < 3:
            return httpx.Response(503, text="overloaded")
        return httpx.Response(200, json=answer([1], [-1.0], {"type": "length", "length": 1}))

    client = SGLangClient("http://a", max_retries=3, backoff_s=0.001, transport=transport(FakeServers({"a": flaky})))
    assert (await client.generate(GenerateRequest([1]))).output_ids == [1]
    assert attempts["n"] == 3

    fake = FakeServers({"a": lambda req, body: httpx.Response(400, json={"error": {"message": "top_k must be -1"}})})
    client = SGLangClient("http://a", max_retries=3, backoff_s=0.001, transport=transport(fake))
    with pytest.raises(EngineError, match="rejected with 400") as info:
        await client.generate(GenerateRequest([1]))
    assert not isinstance(info.value, EngineUnavailable) and len(fake.calls) == 1


async def test_persistent_5xx_becomes_engine_unavailable_after_the_retries():
    fake = FakeServers({"a": lambda req, body: httpx.Response(500, text="boom")})
    client = SGLangClient("http://a", max_retries=2, backoff_s=0.001, transport=transport(fake))
    with pytest.raises(EngineUnavailable, match="server error 500") as info:
        await client.generate(GenerateRequest([1]))
    assert isinstance(info.value.__cause__, httpx.HTTPStatusError) and len(fake.calls) == 3


async def test_a_timeout_is_engine_timeout_and_not_retried():
    calls = []

    def slow(request):
        calls.append(request)
        raise httpx.ReadTimeout("no answer", request=request)

    client = SGLangClient("http://a", max_retries=3, backoff_s=0.001, transport=httpx.MockTransport(slow))
    with pytest.raises(EngineTimeout) as info:
        await client.generate(GenerateRequest([1]))
    assert isinstance(info.value.__cause__, httpx.ReadTimeout) and len(calls) == 1


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def test_every_httpx_error_maps_to_an_engine_error():
    request = httpx.Request("POST", "http://a/generate")
    for cls in [httpx.HTTPError, *_all_subclasses(httpx.HTTPError)]:
        if cls is httpx.HTTPStatusError:
            exc = cls("x", request=request, response=httpx.Response(502, request=request))
        elif issubclass(cls, httpx.RequestError):
            exc = cls("x", request=request)
        else:
            exc = cls("x")
        mapped = map_http_error(exc, "http://a")
        assert isinstance(mapped, EngineError), cls
        if issubclass(cls, httpx.TimeoutException):
            assert isinstance(mapped, EngineTimeout), cls
        elif issubclass(cls, (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)) or cls is httpx.HTTPStatusError:
            assert isinstance(mapped, EngineUnavailable), cls


async def test_update_from_disk_failure_names_the_server_and_the_reason():
    fake = FakeServers({"a": lambda req, body: httpx.Response(400, json={"success": False, "message": "no such dir"})})
    client = SGLangClient("http://a", transport=transport(fake))
    with pytest.raises(EngineError, match=r"http://a/update_weights_from_disk failed \(400\): no such dir"):
        await client.update_weights_from_disk("/nope", weight_version="2")
    assert fake.calls[0][2] == {"model_path": "/nope", "flush_cache": True, "abort_all_requests": False, "weight_version": "2"}


async def test_state_dict_update_is_refused_with_what_to_do_instead():
    engine = SGLangEngine(["http://a"], transport=transport(FakeServers({})))
    with pytest.raises(ValueError, match="pass path=, or use init_weights_update_group"):
        await engine.update_weights({"w": torch.zeros(1)})


async def test_nccl_payloads_give_each_server_its_rank_offset_and_announce_tensors_in_order(monkeypatch):
    def server(tp):
        def handle(req, body):
            if req.url.path == "/get_server_info":
                return httpx.Response(200, json={"tp_size": tp})
            return httpx.Response(200, json={"success": True, "message": "ok"})

        return handle

    fake = FakeServers({"a": server(2), "b": server(1)})
    joined, sent = [], []
    monkeypatch.setattr("agentrl.engines.weight_sync.init_update_group", lambda **kw: joined.append(kw) or "group")
    monkeypatch.setattr("agentrl.engines.weight_sync.broadcast_from_trainer", lambda group, tensors: sent.append((group, [t.shape for t in tensors])))
    engine = SGLangEngine(["http://a", "http://b"], transport=transport(fake))
    await engine.init_weights_update_group(master_address="10.0.0.1", master_port=29600, backend="nccl", group_name="g")
    inits = {host: body for host, path, body in fake.calls if path == "/init_weights_update_group"}
    assert inits["a"] == {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 4, "group_name": "g", "backend": "nccl"}
    assert inits["b"]["rank_offset"] == 3 and inits["b"]["world_size"] == 4
    assert joined[0]["rank"] == 0 and joined[0]["world_size"] == 4

    tensors = [("embed", torch.zeros(4, 2, dtype=torch.bfloat16)), ("norm", torch.ones(2)), ("head", torch.zeros(3, 2))]
    await engine.update_weights_from_distributed(tensors, version=9, bucket_bytes=24)
    updates = [(host, body) for host, path, body in fake.calls if path == "/update_weights_from_distributed"]
    a_updates = [body for host, body in updates if host == "a"]
    assert [b["names"] for b in a_updates] == [["embed", "norm"], ["head"]]  # 16 + 8 bytes, then 24
    assert a_updates[0]["dtypes"] == ["bfloat16", "float32"] and a_updates[0]["shapes"] == [[4, 2], [2]]
    assert [b.get("weight_version") for b in a_updates] == [None, "9"]  # the version moves with the last bucket
    assert sent == [("group", [torch.Size([4, 2]), torch.Size([2])]), ("group", [torch.Size([3, 2])])]
    assert engine.weight_version == 9


def test_the_module_exports_what_it_documents():
    assert set(sglang_module.__all__) == {"SGLangClient", "SGLangEngine", "generate_payload", "parse_generate_response", "map_http_error"}


async def test_an_update_whose_flush_sglang_refused_flushes_again_once_the_scheduler_is_idle():
    """SGLang 0.5.23 loads the weights and then refuses the flush while its scheduler still holds
    the requests the update aborted (seen on the real server with abort_all_requests)."""
    refused = {"success": False, "message": "Weights were updated, but the cache was not flushed because requests are "
                                            "still running or queued. Retract or finish them, then call /flush_cache."}
    flushes = []

    def handler(req, body):
        if req.url.path == "/update_weights_from_disk":
            return httpx.Response(400, json=refused)
        flushes.append(str(req.url))
        return httpx.Response(200 if len(flushes) == 1 else 400, text="Timed out waiting for idle state.")

    client = SGLangClient("http://a", transport=transport(FakeServers({"a": handler})))
    await client.update_weights_from_disk("/w", weight_version="3", abort_all_requests=True, flush_wait_s=30)
    assert flushes == ["http://a/flush_cache?timeout=30"]
    with pytest.raises(EngineError, match=r"http://a/flush_cache\?timeout=30: request rejected with 400: Timed out waiting for idle state"):
        await client.update_weights_from_disk("/w", weight_version="4", abort_all_requests=True, flush_wait_s=30)
    other = {"success": False, "message": "failed to load weights from /w: no such directory"}
    client = SGLangClient("http://a", transport=transport(FakeServers({"a": lambda req, body: httpx.Response(400, json=other)})))
    with pytest.raises(EngineError, match="update_weights_from_disk failed \\(400\\): failed to load weights"):
        await client.update_weights_from_disk("/w")

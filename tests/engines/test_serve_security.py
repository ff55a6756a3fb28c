"""`agentrl serve` as a network peer sees it (real server over real HTTP on 127.0.0.1): every
endpoint but GET /health needs the API key, a non-loopback bind without a key is refused, hostile
bodies get 400/413 and the server keeps serving, and the key never reaches a log, the rollout
store or a report."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.engines.guard import API_KEY_ENV, auth_headers, is_loopback, new_api_key
from agentrl.engines.launch import ServerSpec, launch_servers, serve_specs
from agentrl.engines.serve import build_app
from agentrl.errors import EngineError
from enginetest import load_reference, reference_greedy

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
MAX_BODY = 64 * 1024
ENDPOINTS = [  # every route of build_app (the test below checks the list is complete)
    ("POST", "/generate"), ("GET", "/health_generate"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
    ("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/abort_request"), ("POST", "/update_weights_from_disk"),
    ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    launched = launch_servers(serve_specs(model_dir, extra_args=("--max-request-bytes", str(MAX_BODY), "--log-level", "info")),
                              ready_timeout_s=120, log_dir=logs)
    yield launched.servers[0]
    launched.stop()


def greedy_body(n: int = 6) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}


def test_every_endpoint_but_health_answers_401_without_the_key(server, model_dir):
    from agentrl.engines.builtin import BuiltinEngine

    engine = BuiltinEngine(model_dir)
    try:
        routes = {(m, r.path) for r in build_app(engine, str(model_dir)).routes for m in r.methods if m != "HEAD"}
    finally:
        engine.close()
    assert routes == set(ENDPOINTS) | {("GET", "/health")}
    wrong = [{}, {"Authorization": "Bearer " + new_api_key()}, {"Authorization": f"Basic {server.api_key}"},
             {"Authorization": server.api_key}, {"Authorization": "Bearer " + server.api_key[:-1]}]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in ENDPOINTS:
            for headers in wrong:
                reply = http.request(method, path, json={}, headers=headers)
                assert reply.status_code == 401, (method, path, headers)
                assert reply.json()["error"]["message"] == "missing or wrong API key: send Authorization: Bearer <key>"
        assert http.get("/health").status_code == 200 and http.get("/health").content == b""
        ok = http.post("/generate", json=greedy_body(), headers=auth_headers(server.api_key))
        assert ok.status_code == 200 and ok.json()["output_ids"] == reference_greedy(load_reference(model_dir), PROMPT, 6)
        assert http.get("/get_server_info", headers=auth_headers(server.api_key)).status_code == 200


def test_a_client_without_the_key_gets_an_error_that_says_so(server):
    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.sglang import SGLangClient

    async def call():
        client = SGLangClient(server.url, api_key="not-the-key", max_retries=0)
        try:
            await client.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=1)))
        finally:
            await client.aclose()

    with pytest.raises(EngineError, match="401 unauthorized: the server needs its API key"):
        asyncio.run(call())


def test_serving_beyond_loopback_without_a_key_is_refused_with_how_to_set_one(model_dir, tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    done = subprocess.run([sys.executable, "-m", "agentrl.engines.serve", "--model", str(model_dir), "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "--host 0.0.0.0 is not a loopback address and no API key is set" in done.stderr
    assert f"export {API_KEY_ENV}=" in done.stderr
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="not a loopback address and no API key is set"):
        launch_servers([ServerSpec(["true"], port=1, host="10.1.2.3")], ready_timeout_s=5)
    assert list(tmp_path.iterdir()) == []  # refused before its log directory was made
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.1", "example.com")] == [
        True, True, True, True, False, False, False]  # fmt: skip


def test_hostile_bodies_get_400_or_413_naming_the_field_and_the_server_keeps_serving(server, model_dir, tmp_path):
    marker = tmp_path / "pwned"

    class RunsACommand:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    hostile_weights = tmp_path / "hostile"
    hostile_weights.mkdir()
    (hostile_weights / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    torch.save({"model.norm.weight": RunsACommand()}, hostile_weights / "pytorch_model.bin")
    expected = reference_greedy(load_reference(model_dir), PROMPT, 6)
    cases = [  # (path, raw body or JSON, status, text the answer must contain)
        ("/generate", b"x" * (MAX_BODY + 1), 413, f"at most {MAX_BODY}"),
        ("/generate", b"{\"input_ids\": [1,", 400, "not valid JSON"),
        ("/generate", b"\xff\xfe\x00garbage", 400, "not valid JSON"),
        ("/generate", b"[" * 30_000 + b"]" * 30_000, 400, "not valid JSON"),
        ("/generate", [1, 2], 400, "the body must be a JSON object"),
        ("/generate", {"input_ids": "12"}, 400, "input_ids must be a non-empty list"),
        ("/generate", {"input_ids": [1, "2"]}, 400, "input_ids must contain only integers"),
        ("/generate", {"input_ids": [1, True]}, 400, "input_ids must contain only integers"),
        ("/generate", {"input_ids": [[1], 2]}, 400, "input_ids[1] must be a non-empty list"),
        ("/generate", {"input_ids": [10**30]}, 400, "outside the vocabulary"),
        ("/generate", {"input_ids": [-1]}, 400, "outside the vocabulary"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature must be a finite number"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, 400, "sampling_params.max_new_tokens must be a finite integer"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": [3]}}, 400, "sampling_params.top_k must be a finite integer"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": "7"}}, 400, "sampling_params.stop_token_ids must be a list"),
        ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": "x"}}, 400, "sampling_params.sampling_seed must be an integer"),
        ("/generate", {"input_ids": [1], "sampling_params": {"evil": 1}}, 400, "unknown parameter(s) evil"),
        ("/generate", {"input_ids": [1], "sampling_params": "{{ ''.__class__ }}"}, 400, "sampling_params must be a dict"),
        ("/generate", {"input_ids": [1], "rid": 7}, 400, "rid must be a str"),
        ("/abort_request", {"rid": ["a"]}, 400, "abort_request needs rid (a string)"),
        ("/update_weights_from_disk", {"model_path": 3}, 400, "model_path (a directory) is required"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, 400, "failed to load weights from /nonexistent/dir"),
        ("/update_weights_from_disk", {"model_path": str(hostile_weights)}, 400, "not a readable weights file of plain tensors"),
        ("/update_weights_from_distributed", {"names": "x", "dtypes": [], "shapes": []}, 400, "names must be a list"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[10**12]]}, 400,
         "shapes[0]: model.norm.weight has shape [64] in the served model, not [1000000000000]"),
        ("/update_weights_from_distributed", {"names": ["no.such"], "dtypes": ["float32"], "shapes": [[1]]}, 400,
         "names[0]: 'no.such' is not a parameter of the served model"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["__class__"], "shapes": [[64]]}, 400,
         "dtypes[0]: unknown dtype '__class__'"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1"}, 400, "missing field master_port"),
    ]  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60, headers=auth_headers(server.api_key)) as http:
        for path, body, status, text in cases:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert (reply.status_code, text in reply.text) == (status, True), (path, str(body)[:80], reply.text[:300])

        # a chunked body (no Content-Length) is cut off at the bound too
        def chunks():
            for _ in range(MAX_BODY // 1024 + 2):
                yield b" " * 1024

        reply = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert reply.status_code == 413
        # random mutations of a good body: never a 500, never a dead server
        rng = random.Random(0)
        junk = [None, True, -1, 2**70, 1.5, float("nan"), "", "x" * 5000, [], {}, [[]], {"a": [1]}, "{{7*7}}"]
        for _ in range(150):
            body = greedy_body()
            params = body["sampling_params"]
            target = rng.choice(["input_ids", "sampling_params", "rid", "return_logprob", *params])
            value = rng.choice(junk)
            (params if target in params else body)[target] = value
            reply = http.post("/generate", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert reply.status_code in (200, 400), (target, value, reply.status_code, reply.text[:300])
        assert http.get("/health").status_code == 200
        good = http.post("/generate", json=greedy_body())
        assert good.status_code == 200 and good.json()["output_ids"] == expected
    assert not marker.exists()  # the weights' pickle was refused, not run
    assert server.alive()


def test_the_api_key_never_reaches_logs_the_rollout_store_or_a_report(model_dir, tiny_model_dir, tiny_tokenizer, tmp_path, caplog):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import AgentConfig, DataConfig, RolloutConfig, TrainConfig
    from agentrl.data.dataset import rows_from_dicts
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.engines.sglang import SGLangEngine
    from agentrl_data_prep.tasks import generate

    key = new_api_key()
    logs, store_dir = tmp_path / "logs", tmp_path / "rollouts"
    caplog.set_level(logging.DEBUG)  # every logger, httpx's request lines included
    launched = launch_servers(serve_specs(tiny_model_dir, api_key=key, extra_args=("--log-level", "debug")),
                              ready_timeout_s=120, log_dir=logs)
    try:
        engine = SGLangEngine(launched.urls, api_key=key, max_retries=0)
        setup = RolloutSetup.from_config(TrainConfig(
            agent=AgentConfig(max_assistant_turns=2), rollout=RolloutConfig(max_new_tokens=8), data=DataConfig(max_response_length=32),
        ))  # fmt: skip
        ctx = build_context(engine, tiny_tokenizer, setup)
        rows = rows_from_dicts(generate("arith", 2, seed=1))

        async def main():
            try:
                return await RolloutRunner(ctx, LoopTable("tool_agent"), max_concurrency=2).run(rows, n=1, seed=0)
            finally:
                await engine.aclose()

        trajectories = asyncio.run(main())
        assert len(trajectories) == 2 and all(t.finish_reason != "engine_error" for t in trajectories)
        RolloutStore(store_dir).write_step(1, trajectories, rows=rows)
        with httpx.Client(base_url=launched.urls[0]) as http:  # a refused call is logged by the server too
            assert http.post("/flush_cache", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        launched.stop()
    report = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "replay", "report", str(store_dir), "--output", str(report)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.parent for p in written} >= {logs, store_dir} and report in written
    assert "GET /health_generate" in (logs / f"server-{launched.servers[0].spec.port}.log").read_text()  # the log is real
    for path in written:
        assert key.encode() not in path.read_bytes(), path
    assert key not in caplog.text and key not in done.stdout + done.stderr
    assert key not in repr(launched.servers[0].spec)

"""Smaller parts of the engines: request parsing, checkpoint reading, launching, the package facade."""

from __future__ import annotations

import importlib

import subprocess
import sys

import httpx
import pytest
import torch

import agentrl.engines as engines
from agentrl.engines.base import GenerateRequest, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.launch import ServerSpec, free_port, launch_servers, sglang_specs
from agentrl.engines.serve import BadRequest, build_app, parse_generate
from agentrl.engines.weights import copy_weights_into, read_checkpoint
from agentrl.errors import EngineUnavailable
from enginetest import build_qwen2, reference_logprobs


def test_generate_body_becomes_engine_requests_with_eos_added_as_a_stop():
    parsed = parse_generate(
        {
            "input_ids": [[1, 2], [3]],
            "sampling_params": [{"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [7], "stop": "\n\n"},
                                {"ignore_eos": True, "sampling_seed": 4, "stop": ["END", "Observation:"]}],
            "rid": ["a", "b"],
            "return_logprob": True,
        },
        defaults={"temperature": 0.7},
        eos_token_ids=(2,),
    )
    first, second = parsed.requests
    assert (first.input_ids, first.rid, first.sampling) == ([1, 2], "a", SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=(7, 2), stop=("\n\n",)))
    # unset parameters come from the model's generation config, then SGLang's defaults
    assert second.sampling == SamplingParams(max_new_tokens=128, temperature=0.7, top_p=1.0, top_k=-1, stop_token_ids=(),
                                             stop=("END", "Observation:"), seed=4)
    assert parsed.batched and parsed.return_logprob == [True, True]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "the body must be a JSON object"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [1, "x"]}, "input_ids must contain only integers"),
        ({"input_ids": [[1], []]}, "input_ids[1] must be a non-empty list"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n=2 is not supported"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "sampling_params: unknown parameter(s) temprature"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries for 2 prompts"),
        ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop must be a string or a list of non-empty strings"),
    ],
)
def test_malformed_generate_bodies_are_rejected_naming_the_field(body, message):
    with pytest.raises(BadRequest) as info:
        parse_generate(body, defaults={}, eos_token_ids=())
    assert message in str(info.value)


@pytest.mark.anyio
async def test_served_text_is_the_tokenizers_decoding_of_the_output(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = BuiltinEngine(tiny_model_dir)
    prompt = tokenizer("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    try:
        app = build_app(engine, str(tiny_model_dir), tokenizer=tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1}, "return_logprob": True}
            reply = (await http.post("/generate", json=body)).json()
            info = (await http.get("/get_model_info")).json()
    finally:
        engine.close()
    assert reply["text"] == tokenizer.decode(reply["output_ids"])
    logprobs = [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert logprobs == pytest.approx(reference_logprobs(reference, prompt, reply["output_ids"], 1.0), abs=1e-5)
    assert (info["model_type"], info["weight_version"], info["is_generation"]) == ("qwen2", "0", True)


@pytest.mark.anyio
async def test_module_forward_fallback_matches_the_fast_path(model_dir):
    from agentrl.engines._packed import ModuleForward, PackedDecoderForward

    request = GenerateRequest([4, 8, 15, 16, 23, 42], SamplingParams(max_new_tokens=10, temperature=0.8, seed=2))
    outputs = []
    for forward in (PackedDecoderForward, ModuleForward):
        engine = BuiltinEngine(model_dir)
        engine._scheduler.forward = forward(engine.model, engine.max_seq_len) if forward is PackedDecoderForward else forward(engine.model)
        try:
            outputs.append(await engine.generate(request))
        finally:
            engine.close()
    assert outputs[0].output_ids == outputs[1].output_ids
    # fp32 rounding apart: the fast path multiplies on CPU through oneDNN, the module path through
    # torch's default GEMM (measured 1.9e-6 at logprobs near -6, relative 4e-7)
    assert outputs[0].logprobs == pytest.approx(outputs[1].logprobs, rel=1e-6, abs=1e-6)


def test_sharded_checkpoint_is_read_whole_and_partial_updates_need_strict_false(tmp_path):
    model = build_qwen2(seed=3)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    state = read_checkpoint(tmp_path)
    target = build_qwen2(seed=4)
    assert copy_weights_into(target, state) == len(state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    bucket = {"model.norm.weight": torch.full((64,), 2.0)}
    with pytest.raises(ValueError, match="no value for"):
        copy_weights_into(target, bucket)
    assert copy_weights_into(target, bucket, strict=False) == 1
    assert torch.equal(target.model.norm.weight, torch.full((64,), 2.0))


def test_missing_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        read_checkpoint(tmp_path)


def test_sglang_servers_get_their_own_gpus_and_ports():
    specs = sglang_specs("/ckpt", num_servers=2, tp_size=2, python="/venv/bin/python", ports=[30000, 30001], extra_args=("--dtype", "bfloat16"))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    key = specs[0].api_key
    assert len(key) >= 43 and specs[1].api_key == key  # 256 random bits, one key per launch
    assert specs[1].command == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--tp-size", "2",
        "--host", "127.0.0.1", "--port", "30001", "--api-key", key, "--dtype", "bfloat16",
    ]  # fmt: skip
    assert specs[1].url == "http://127.0.0.1:30001"
    assert key not in repr(specs[1]) and "<api-key>" in repr(specs[1])
    assert sglang_specs("/ckpt", ports=[1])[0].api_key != key  # a fresh key for every launch


def test_a_server_key_is_one_command_line_value_even_when_its_random_part_starts_with_a_dash(monkeypatch):
    import argparse
    import secrets

    from agentrl.engines.guard import new_api_key

    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + "x" * 42)  # what token_urlsafe returns once in 64 draws
    key = new_api_key()
    [spec] = sglang_specs("/ckpt", ports=[30000], api_key=key)
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    parser.add_argument("--model-path")
    i = spec.command.index("--api-key")
    assert parser.parse_args(spec.command[i : i + 2]).api_key == key


def test_a_server_that_dies_during_start_up_is_reported_with_its_log(tmp_path):
    spec = ServerSpec([sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"], port=1)
    with pytest.raises(EngineUnavailable) as info:
        launch_servers([spec], ready_timeout_s=30, log_dir=tmp_path)
    assert "exited with 3 during start-up" in str(info.value) and "bad flag --foo" in str(info.value)


HEALTHY_SERVER = """
import http.server, sys
class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Healthy).serve_forever()
"""


# as SGLang names its inter-process sockets: a temporary file it never removes
LEAKY_SERVER = "import tempfile; print('socket at', tempfile.NamedTemporaryFile(delete=False).name, flush=True)\n" + HEALTHY_SERVER


def test_servers_launched_without_a_log_dir_keep_their_logs_and_temp_files_in_temp_dirs_that_stop_removes(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    port = free_port()
    launched = launch_servers([ServerSpec([sys.executable, "-c", LEAKY_SERVER, str(port)], port=port)], ready_timeout_s=30)
    [log_dir] = tmp_path.glob("agentrl-servers-*")
    log = (log_dir / f"server-{port}.log").read_text()
    [server_tmp] = tmp_path.glob("agentrl-srv-*")  # the server's own TMPDIR
    assert f"socket at {server_tmp}/" in log
    launched.stop()
    assert list(tmp_path.iterdir()) == []


def test_agentrl_serve_help_runs_without_a_model():
    result = subprocess.run([sys.executable, "-m", "agentrl.engines.serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--max-batch-size" in result.stdout


def test_engines_package_exports_what_it_documents():
    # the boundary types only: the engines come from their modules (torch, httpx)
    assert set(engines.__all__) == {"Engine", "FinishReason", "GenerateRequest", "GenerateResult", "SamplingParams"}
    for name in engines.__all__:
        assert getattr(engines, name).__name__ == name
    for module, names in [("builtin", ["BuiltinEngine", "EngineStats", "StepRecord"]), ("sglang", ["SGLangEngine", "SGLangClient"]),
                          ("launch", ["ServerSpec", "launch_servers", "sglang_specs", "serve_specs"])]:
        for name in names:
            assert getattr(importlib.import_module(f"agentrl.engines.{module}"), name).__name__ == name


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_a_llama_with_mlp_biases_takes_the_module_forward(mlp_bias):
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.engines._packed import ModuleForward, PackedDecoderForward, make_forward

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, mlp_bias=mlp_bias)
    forward = make_forward(LlamaForCausalLM(config), max_len=16)
    # the functional layers have no MLP biases: such a model must not run through them
    assert isinstance(forward, ModuleForward if mlp_bias else PackedDecoderForward)


def test_onednn_linear_follows_in_place_and_replaced_weights():
    from agentrl.engines._packed import OneDNNLinear

    torch.manual_seed(0)
    linear = OneDNNLinear(min_weight_elements=0)  # the test's layer is small
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)

    def expected(rows):
        return torch.nn.functional.linear(rows, layer.weight, layer.bias)

    assert OneDNNLinear.serves(layer.weight)
    assert torch.allclose(linear(x, layer), expected(x), atol=1e-6)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves, the held copy must not be used
    assert torch.allclose(linear(x, layer), expected(x), atol=1e-6)
    layer.weight = torch.nn.Parameter(torch.randn(8, 16))  # replaced: another tensor
    assert torch.allclose(linear(x, layer), expected(x), atol=1e-6)
    assert len(linear._copies) == 1  # one copy per module, not one per version
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    layer(x).sum().backward()
    optimizer.step()  # the fused kernel leaves the version counter where it was ...
    assert not torch.allclose(linear(x, layer), expected(x), atol=1e-3)
    linear.forget()  # ... so the engine forgets its copies on every weight update
    assert torch.allclose(linear(x, layer), expected(x), atol=1e-6)
    many = torch.randn(1000, 16)  # long prefills run on the same copy, laid out for fewer rows
    assert torch.allclose(linear(many, layer), expected(many), atol=1e-5)
    one = torch.randn(1, 16)
    assert torch.equal(linear(one, layer), expected(one))  # a single row keeps torch's GEMM
    assert torch.equal(OneDNNLinear()(x, layer), expected(x))  # and so do small weights
    assert not OneDNNLinear.serves(layer.weight.to(torch.bfloat16))


def test_onednn_linear_many_is_one_product_on_the_stacked_copy_and_follows_each_parameter():
    """The query, key and value projections as one product: each output as ``F.linear`` gives it,
    as views of one tensor; a changed bias of any one of them is seen (the stacked copy holds
    the biases joined), and the torch fallback returns the same."""
    from agentrl.engines._packed import OneDNNLinear, TorchLinear

    torch.manual_seed(0)
    modules = (torch.nn.Linear(16, 12), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(6, 16)
    linear = OneDNNLinear(min_weight_elements=0)

    def check(outputs):
        assert [tuple(o.shape) for o in outputs] == [(6, 12), (6, 4), (6, 4)]
        for out, module in zip(outputs, modules):
            assert torch.allclose(out, torch.nn.functional.linear(x, module.weight, module.bias), atol=1e-6)

    outputs = linear.many(x, modules)
    check(outputs)
    assert outputs[0].untyped_storage().data_ptr() == outputs[2].untyped_storage().data_ptr()  # one product
    assert outputs[1].stride(0) == 20  # rows of the stacked output
    with torch.no_grad():
        modules[1].bias.add_(1.0)  # in place, one bias of three
    check(linear.many(x, modules))
    modules[2].weight = torch.nn.Parameter(torch.randn(4, 16))  # replaced
    check(linear.many(x, modules))
    assert len(linear._copies) == 1
    check(TorchLinear().many(x, modules))
    assert all(o.is_contiguous() for o in OneDNNLinear().many(x, modules))  # small weights: torch's GEMM, one each

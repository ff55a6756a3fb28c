"""Inference engines: token ids in, token ids + logprobs out.

    BuiltinEngine    continuous batching over a transformers causal LM (CPU default, tests)
    SGLangEngine     several SGLang servers over HTTP (GPUs): balancing, sticky sessions, failover
    SGLangClient     one server, SGLang's native /generate protocol
    launch_servers   start SGLang or `agentrl serve` subprocesses and wait until they generate

The boundary types (``GenerateRequest``, ``GenerateResult``, ``SamplingParams``, ``FinishReason``,
``Engine``) live in ``agentrl.engines.base``. Only torch-free modules are re-exported here, so
importing the package loads neither torch nor transformers: ``BuiltinEngine`` (and its
``EngineStats``, ``StepRecord``) is imported from ``agentrl.engines.builtin``.
"""

from __future__ import annotations

from agentrl.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.engines.launch import ServerSpec, launch_servers, serve_specs, sglang_specs
from agentrl.engines.sglang import SGLangClient, SGLangEngine

__all__ = [
    "Engine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "SamplingParams",
    "SGLangClient",
    "SGLangEngine",
    "ServerSpec",
    "launch_servers",
    "serve_specs",
    "sglang_specs",
]

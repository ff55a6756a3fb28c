"""Inference engines: token ids in, token ids + logprobs out.

    agentrl.engines.builtin.BuiltinEngine   continuous batching over a transformers causal LM (CPU default, tests)
    agentrl.engines.sglang.SGLangEngine     several SGLang servers over HTTP (GPUs): balancing, sticky sessions, failover
    agentrl.engines.sglang.SGLangClient     one server, SGLang's native /generate protocol
    agentrl.engines.launch.launch_servers   start SGLang or `agentrl serve` subprocesses and wait until they generate

This package re-exports only the boundary types of ``agentrl.engines.base`` (``GenerateRequest``,
``GenerateResult``, ``SamplingParams``, ``FinishReason``, ``Engine``). The engines are imported
from their modules: the built-in one loads torch and transformers, the SGLang client httpx, and
``import agentrl`` (which reaches this package) should load none of them.
"""

from __future__ import annotations

from agentrl.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams

__all__ = ["Engine", "FinishReason", "GenerateRequest", "GenerateResult", "SamplingParams"]

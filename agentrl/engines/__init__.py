"""Inference engines: token ids in, token ids + logprobs out.

    BuiltinEngine    continuous batching over a transformers causal LM (CPU default, tests)
    SGLangEngine     several SGLang servers over HTTP (GPUs): balancing, sticky sessions, failover
    SGLangClient     one server, SGLang's native /generate protocol
    launch_servers   start SGLang or `agentrl serve` subprocesses and wait until they generate

The boundary types (``GenerateRequest``, ``GenerateResult``, ``SamplingParams``, ``FinishReason``,
``Engine``) live in ``agentrl.engines.base``. Names here are imported on first use, so importing
the package does not load transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "BuiltinEngine": "agentrl.engines.builtin",
    "EngineStats": "agentrl.engines.builtin",
    "StepRecord": "agentrl.engines.builtin",
    "SGLangEngine": "agentrl.engines.sglang",
    "SGLangClient": "agentrl.engines.sglang",
    "ServerSpec": "agentrl.engines.launch",
    "launch_servers": "agentrl.engines.launch",
    "sglang_specs": "agentrl.engines.launch",
    "serve_specs": "agentrl.engines.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

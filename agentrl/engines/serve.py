"""``agentrl serve``: the built-in engine behind SGLang's native HTTP protocol.

    agentrl serve --model DIR [--host 127.0.0.1] [--port 30000] [--max-batch-size 64] ...
    AGENTRL_API_KEY=KEY agentrl serve --model DIR --host 0.0.0.0       (or --api-key-file PATH)

With a key (``AGENTRL_API_KEY`` or ``--api-key-file``) every endpoint but ``GET /health`` needs
``Authorization: Bearer <key>`` and answers 401 without it; a non-loopback ``--host`` without a
key is refused. Bodies above ``--max-request-bytes`` get 413, malformed JSON 400 (see guard.py).

Endpoints (request and response JSON as SGLang's, see docs/facts in the repository):

    POST /generate                     input_ids (one list, or a list of lists = a batch), sampling_params,
                                       return_logprob, rid -> {text, output_ids, meta_info}
    GET  /health, /health_generate     200 when the engine serves (the latter runs one token)
    GET  /get_model_info, /get_server_info
    POST /flush_cache                  forget retained prefixes
    POST /abort_request                {rid} or {abort_all: true}
    POST /update_weights_from_disk     {model_path, weight_version?, abort_all_requests?} -> {success, message}
    POST /init_weights_update_group    {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, weight_version?}
    POST /destroy_weights_update_group {group_name}

Like SGLang, sampling parameters a request leaves out take the values in the model's
``generation_config.json`` (else SGLang's defaults), and generation also stops at the model's
EOS token(s) unless ``ignore_eos`` is set. Text prompts are refused (this server has no
tokenizer contract; send token ids). ``text`` in responses is decoded when the model directory
has a tokenizer, else empty. A malformed request gets a 400 naming the offending field.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from agentrl.engines.builtin import BuiltinEngine
from agentrl.engines.guard import DEFAULT_MAX_BODY_BYTES, Guard, api_key_from_env, read_key_file, require_key_off_loopback
from agentrl.errors import EngineUnavailable

__all__ = ["build_app", "cli_main", "parse_generate", "BadRequest"]

log = logging.getLogger("agentrl.serve")

# SGLang's defaults for the parameters this server implements.
_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
# Parameters SGLang knows that this server accepts only at their neutral value.
_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
# Parameters that only shape the text output; accepted and ignored.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


class BadRequest(ValueError):
    """The request cannot be served as sent (answered with HTTP 400)."""


@dataclass(frozen=True, slots=True)
class ParsedGenerate:
    requests: list[GenerateRequest]
    return_logprob: list[bool]
    batched: bool


def parse_generate(
    body: Any, *, defaults: dict[str, Any], eos_token_ids: tuple[int, ...]
) -> ParsedGenerate:
    """Validate a /generate body into engine requests; raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("text") is not None:
        raise BadRequest("text prompts are not supported: send token ids in input_ids")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by agentrl serve")
    if body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("top_logprobs_num is not supported (only the sampled tokens' logprobs are returned)")
    if body.get("logprob_start_len") not in (None, -1):
        raise BadRequest("logprob_start_len must be -1: prompt logprobs are not supported")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    count = len(prompts)
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest(f"{where} must contain only integers")
    sampling = _per_request(body.get("sampling_params"), count, "sampling_params", dict, {})
    rids = _per_request(body.get("rid"), count, "rid", str, None)
    return_logprob = _per_request(body.get("return_logprob"), count, "return_logprob", bool, False)
    if batched and rids[0] is not None and len(set(rids)) != len(rids):
        raise BadRequest("rid values within a batch must be distinct")
    requests = []
    for i, (prompt, params, rid) in enumerate(zip(prompts, sampling, rids)):
        where = f"sampling_params[{i}]" if batched and isinstance(body.get("sampling_params"), list) else "sampling_params"
        requests.append(GenerateRequest(list(prompt), _sampling(params, where, defaults, eos_token_ids), rid=rid or uuid.uuid4().hex))
    return ParsedGenerate(requests, return_logprob, batched)


def _per_request(value: Any, count: int, field: str, kind: type, default: Any) -> list:
    if value is None:
        return [default] * count
    if isinstance(value, list) and kind is not list:
        if len(value) != count:
            raise BadRequest(f"{field} has {len(value)} entries for {count} prompts")
        values = value
    else:
        values = [value] * count
    for v in values:
        if not isinstance(v, kind) and v is not None:
            raise BadRequest(f"{field} must be a {kind.__name__} (or a list of them, one per prompt), got {v!r}")
    return [default if v is None else v for v in values]


def _sampling(params: dict, where: str, defaults: dict[str, Any], eos_token_ids: tuple[int, ...]) -> SamplingParams:
    known = set(_DEFAULTS) | set(_NEUTRAL) | _TEXT_ONLY | {"stop_token_ids", "stop", "sampling_seed", "ignore_eos"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise BadRequest(f"{where}: unknown parameter(s) {', '.join(unknown)}")
    for key, neutral in _NEUTRAL.items():
        value = params.get(key, neutral)
        if value != neutral and value not in ([], ""):
            raise BadRequest(f"{where}.{key}={value!r} is not supported by agentrl serve (only {neutral!r})")
    for key in _DEFAULTS:
        _check_number(params.get(key), f"{where}.{key}", integer=key in ("max_new_tokens", "top_k"))
    merged = {**_DEFAULTS, **defaults, **{k: v for k, v in params.items() if k in _DEFAULTS and v is not None}}
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"{where}.stop_token_ids must be a list of token ids")
    if not params.get("ignore_eos"):
        stop_ids = [*stop_ids, *(t for t in eos_token_ids if t not in stop_ids)]
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"{where}.stop must be a string or a list of non-empty strings")
    seed = params.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"{where}.sampling_seed must be an integer")
    try:
        return SamplingParams(
            max_new_tokens=int(merged["max_new_tokens"]),
            temperature=float(merged["temperature"]),
            top_p=float(merged["top_p"]),
            top_k=int(merged["top_k"]),
            stop_token_ids=tuple(stop_ids),
            stop=tuple(stop),
            seed=seed,
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where}: {exc}") from exc


def _check_number(value: Any, field: str, *, integer: bool) -> None:
    """None (absent) or a finite number of the right kind; JSON's NaN/Infinity and booleans are not."""
    if value is None:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (isinstance(value, float) and not math.isfinite(value)):
        raise BadRequest(f"{field} must be a finite {'integer' if integer else 'number'}, got {value!r}")


def finish_reason_json(result: GenerateResult) -> dict[str, Any]:
    if result.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": result.matched_stop}
    if result.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "Abort by request (/abort_request or client cancel)"}


class _Server:
    """Request handlers sharing one engine. Kept small: parsing is in parse_generate."""

    def __init__(self, engine: BuiltinEngine, model_path: str, *, tokenizer=None):
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.defaults, self.eos_token_ids = _generation_defaults(Path(model_path), engine)
        self.version_label: str | None = None  # a non-numeric weight_version given by the trainer
        self.in_flight: set[str] = set()
        self.requests_served = 0
        self.groups: dict[str, Any] = {}

    @property
    def weight_version(self) -> str:
        return self.version_label if self.version_label is not None else str(self.engine.weight_version)

    async def generate(self, request: Request) -> Response:
        body = await _read_json(request)
        if isinstance(body, Response):
            return body
        try:
            parsed = parse_generate(body, defaults=self.defaults, eos_token_ids=self.eos_token_ids)
            duplicate = [r.rid for r in parsed.requests if r.rid in self.in_flight]
            if duplicate:
                raise BadRequest(f"rid {duplicate[0]!r} is already in flight")
        except BadRequest as exc:
            return _error(400, str(exc))
        started = time.perf_counter()
        self.requests_served += len(parsed.requests)
        rids = [r.rid for r in parsed.requests]
        self.in_flight.update(rids)
        try:
            results = await asyncio.gather(*(self.engine.generate(r) for r in parsed.requests), return_exceptions=True)
        finally:
            self.in_flight.difference_update(rids)
        for i, result in enumerate(results):
            if isinstance(result, ValueError):
                where = f"input_ids[{i}]: " if parsed.batched else ""
                return _error(400, f"{where}{result}")
            if isinstance(result, EngineUnavailable):
                return _error(503, str(result))
            if isinstance(result, BaseException):
                return _error(500, f"generation failed: {result}")
        latency = time.perf_counter() - started
        out = [
            self._response(req, res, want, latency)
            for req, res, want in zip(parsed.requests, results, parsed.return_logprob)
        ]
        return JSONResponse(out if parsed.batched else out[0])

    def _response(self, request: GenerateRequest, result: GenerateResult, return_logprob: bool, latency: float) -> dict:
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": finish_reason_json(result),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "cached_tokens": result.cached_tokens,
            "e2e_latency": latency,
            # the version that sampled it (as SGLang's, whose requests hold its weights while they run),
            # not the server's version when the answer is written: an update may have ended meanwhile
            "weight_version": self.version_label if self.version_label is not None else str(result.weight_version),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
        text = self.tokenizer.decode(result.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if await self.engine.health() else 503)

    async def health_generate(self, request: Request) -> Response:
        probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=f"health-{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(self.engine.generate(probe), timeout=60)
        except Exception as exc:  # any failure means "not healthy", reported, not raised
            return PlainTextResponse(f"unhealthy: {exc}", status_code=503)
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        config = self.engine.model.config
        return JSONResponse(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "weight_version": self.weight_version,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    async def server_info(self, request: Request) -> Response:
        engine = self.engine
        return JSONResponse(
            {
                "model_path": self.model_path,
                "engine": "agentrl-builtin",
                "device": str(engine.device),
                "dtype": str(engine.model.dtype).removeprefix("torch."),
                "max_running_requests": engine.max_batch_size,
                "context_length": engine.max_seq_len,
                "tp_size": 1,
                "weight_version": self.weight_version,
                "num_requests_served": self.requests_served,
            }
        )

    async def flush_cache(self, request: Request) -> Response:
        await self.engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    async def abort_request(self, request: Request) -> Response:
        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        if body.get("abort_all"):
            await self.engine.abort_all()
        elif isinstance(body.get("rid"), str):
            await self.engine.abort(body["rid"])
        else:
            return _error(400, "abort_request needs rid (a string) or abort_all: true")
        return Response(status_code=200)

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        path = body.get("model_path")
        if not isinstance(path, str):
            return _update_result(False, "model_path (a directory) is required")
        if body.get("abort_all_requests"):
            await self.engine.abort_all()
        version, label = _parse_version(body.get("weight_version"))
        started = time.perf_counter()
        try:
            await self.engine.update_weights(path=path, version=version)
        except Exception as exc:  # a bad directory is the caller's problem, not the server's end
            return _update_result(False, f"failed to load weights from {path}: {exc}")
        self.version_label = label
        return _update_result(True, f"loaded weights from {path} in {time.perf_counter() - started:.3f}s")

    async def init_weights_update_group(self, request: Request) -> Response:
        from agentrl.engines.weight_sync import init_update_group

        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        try:
            name = str(body.get("group_name", "weight_update_group"))
            group = await asyncio.to_thread(
                init_update_group,
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]),  # one rank per server (no tensor parallelism here)
                world_size=int(body["world_size"]),
                group_name=name,
                backend=str(body.get("backend", "nccl")),
            )
        except KeyError as exc:
            return _update_result(False, f"missing field {exc.args[0]}")
        except Exception as exc:  # a failed rendezvous is reported to the trainer, not raised
            return _update_result(False, f"failed to join the weight update group: {exc}")
        self.groups[name] = group
        return _update_result(True, f"joined weight update group {name!r}")

    async def update_weights_from_distributed(self, request: Request) -> Response:
        from agentrl.engines.weight_sync import receive_broadcast

        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        try:
            names, dtypes, shapes = _tensor_announcement(body, self.engine.model.state_dict())
        except BadRequest as exc:
            return _update_result(False, str(exc))
        name = str(body.get("group_name", "weight_update_group"))
        group = self.groups.get(name)
        if group is None:
            return _update_result(False, f"no weight update group {name!r}: call /init_weights_update_group first")
        try:
            tensors = await asyncio.to_thread(receive_broadcast, group, names, dtypes, shapes, self.engine.device)
        except (KeyError, ValueError, RuntimeError) as exc:
            return _update_result(False, f"failed to receive weights: {exc}")
        version, label = _parse_version(body.get("weight_version"))
        try:
            await self.engine.update_weights(tensors, version=version if version is not None else self.engine.weight_version, strict=False)
        except ValueError as exc:
            return _update_result(False, str(exc))
        if body.get("weight_version") is not None:
            self.version_label = label
        return _update_result(True, f"updated {len(tensors)} tensors")

    async def destroy_weights_update_group(self, request: Request) -> Response:
        from agentrl.engines.weight_sync import destroy_update_group

        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        group = self.groups.pop(str(body.get("group_name", "weight_update_group")), None)
        if group is None:
            return _update_result(False, "no such weight update group")
        destroy_update_group(group)
        return _update_result(True, "destroyed")


def _parse_version(value: Any) -> tuple[int | None, str | None]:
    """SGLang's weight_version is a string; a numeric one also becomes the engine's version."""
    if value is None:
        return None, None
    text = str(value)
    return (int(text), None) if text.lstrip("-").isdigit() else (None, text)


def _update_result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, "num_paused_requests": 0}, status_code=200 if success else 400)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _tensor_announcement(body: dict, params: dict[str, Any]) -> tuple[list[str], list[str], list[list[int]]]:
    """names/dtypes/shapes of a distributed update, checked before any tensor is allocated."""
    from agentrl.engines.weight_sync import parse_dtype

    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list):
            raise BadRequest(f"{field} must be a list (one entry per tensor)")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"names, dtypes and shapes must have one entry per tensor (got {len(names)}, {len(dtypes)}, {len(shapes)})")
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str):
            raise BadRequest(f"names[{i}] must be a string")
        if not isinstance(dtype, str):
            raise BadRequest(f"dtypes[{i}] must be a string such as 'bfloat16'")
        try:
            parse_dtype(dtype)
        except ValueError:
            raise BadRequest(f"dtypes[{i}]: unknown dtype {dtype!r}") from None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BadRequest(f"shapes[{i}] must be a list of non-negative integers")
        # nothing is allocated for a tensor the model does not have (an absurd shape would take the memory)
        if name not in params:
            raise BadRequest(f"names[{i}]: {name!r} is not a parameter of the served model")
        if tuple(shape) != tuple(params[name].shape):
            raise BadRequest(f"shapes[{i}]: {name} has shape {list(params[name].shape)} in the served model, not {shape}")
    return names, dtypes, shapes


async def _read_json(request: Request) -> Any:
    """The body as JSON, or a 400 saying why not (bad UTF-8, syntax, nesting too deep to parse)."""
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        return _error(400, f"the body is not valid JSON: {str(exc)[:200]}")


async def _json_object(request: Request) -> dict | Response:
    body = await _read_json(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def _generation_defaults(model_dir: Path, engine: BuiltinEngine) -> tuple[dict[str, Any], tuple[int, ...]]:
    """Sampling defaults and EOS ids the way SGLang takes them from the model directory."""
    raw: dict[str, Any] = {}
    path = model_dir / "generation_config.json"
    if path.is_file():
        raw = json.loads(path.read_text())
    defaults = {k: raw[k] for k in ("temperature", "top_p", "top_k") if raw.get(k) is not None}
    eos = raw.get("eos_token_id", getattr(engine.model.config, "eos_token_id", None))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return defaults, eos_ids


def _load_tokenizer(model_dir: str):
    if not any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None  # (transformers would build an empty tokenizer instead of failing)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # no tokenizer files: responses carry ids only, text stays empty
        return None


def build_app(
    engine: BuiltinEngine, model_path: str, *, tokenizer=None, api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Starlette:
    """The server's app. ``api_key``: required on every endpoint but ``GET /health`` (guard.py)."""
    server = _Server(engine, model_path, tokenizer=tokenizer)
    routes = [
        Route("/generate", server.generate, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/health_generate", server.health_generate, methods=["GET"]),
        Route("/get_model_info", server.model_info, methods=["GET"]),
        Route("/get_server_info", server.server_info, methods=["GET"]),
        Route("/flush_cache", server.flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", server.abort_request, methods=["POST"]),
        Route("/update_weights_from_disk", server.update_weights_from_disk, methods=["POST"]),
        Route("/init_weights_update_group", server.init_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", server.update_weights_from_distributed, methods=["POST"]),
        Route("/destroy_weights_update_group", server.destroy_weights_update_group, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        engine.close()

    guard = Middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return Starlette(routes=routes, lifespan=lifespan, middleware=[guard])


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl serve", description="Serve a model over SGLang's native HTTP protocol.")
    parser.add_argument("--model", required=True, help="a transformers save_pretrained directory, or tiny[:SIZE] (the built-in tiny model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048, help="prompt tokens computed per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--api-key-file", default=None, help="a file holding the API key (default: $AGENTRL_API_KEY; none: no key, loopback only)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies are answered 413")
    args = parser.parse_args(argv)
    try:
        api_key = read_key_file(args.api_key_file) if args.api_key_file else api_key_from_env()
        require_key_off_loopback(args.host, api_key, program="agentrl serve")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if api_key is None:
        print(f"agentrl serve: no API key set: any process on this machine can call every endpoint of {args.host}:{args.port}",
              file=sys.stderr)

    import uvicorn

    from agentrl.tiny import model_dir_arg

    try:
        args.model = str(model_dir_arg(args.model))
    except ValueError as exc:
        parser.error(f"--model {exc}")
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model} is not a directory")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    engine = BuiltinEngine(
        args.model,
        device=args.device,
        dtype=dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_prefill_tokens=args.max_prefill_tokens,
        seed=args.seed,
    )
    app = build_app(engine, str(Path(args.model).resolve()), tokenizer=_load_tokenizer(args.model), api_key=api_key,
                    max_body_bytes=args.max_request_bytes)
    # the one line a quiet server writes to its log: what it serves, and where
    print(f"agentrl serve: {args.model} ({dtype} on {args.device}) listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

"""One SGLang server over its native HTTP protocol (``SGLangClient``; ``sglang.py``'s engine spreads
requests over several).

``SGLangClient`` speaks SGLang's native protocol (``POST /generate`` with ``input_ids``; token ids
in, token ids + logprobs out, never text). Every sampling parameter is sent explicitly, because a
server fills the ones left out from the model's ``generation_config.json``. Transport errors and
5xx answers are retried with exponential backoff; a 4xx is the request's fault and is not.
Failures surface as ``agentrl.errors`` types:

    httpx.TimeoutException                  -> EngineTimeout
    httpx.TransportError, 5xx (after retries) -> EngineUnavailable
    4xx, a malformed answer, other httpx errors -> EngineError

Stop semantics are SGLang's: generation ends at ``stop_token_ids``, at a ``stop`` string (the
token completing it is kept in ``output_ids``; ``matched`` is then the string) *and* at the
model's EOS token(s) (the server's ``ignore_eos`` would disable both, so it is always sent as false).

Every request carries ``Authorization: Bearer <api_key>`` when the client has a key (``api_key=``,
else ``$AGENTRL_API_KEY``): SGLang's ``--api-key`` and ``agentrl serve`` check it (a 401 says so).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Sequence

import httpx

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.guard import API_KEY_ENV, api_key_from_env, auth_headers
from agentrl.errors import EngineError, EngineTimeout, EngineUnavailable

__all__ = ["SGLangClient", "generate_payload", "parse_generate_response", "map_http_error"]

log = logging.getLogger("agentrl.engines.sglang")  # the engine's logger: one name for the backend's messages


def generate_payload(request: GenerateRequest) -> dict[str, Any]:
    """The /generate body for one request, every sampling parameter explicit."""
    sampling = request.sampling
    return {
        "input_ids": list(request.input_ids),
        "sampling_params": {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "min_new_tokens": 0,
            "n": 1,
            "stop_token_ids": list(sampling.stop_token_ids),
            "stop": list(sampling.stop),  # strings: SGLang ends at the token completing one and keeps it (no_stop_trim)
            "ignore_eos": False,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": sampling.seed,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": request.rid,
        "stream": False,
    }


def parse_generate_response(body: Any, *, fallback_version: int = 0) -> GenerateResult:
    """A /generate answer (one request) as a GenerateResult; EngineError if it is malformed."""
    try:
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
        entries = meta.get("output_token_logprobs") or []
        logprobs = [float(entry[0]) for entry in entries]
        logprob_ids = [int(entry[1]) for entry in entries]
        finish = meta["finish_reason"] or {}
        kind = finish.get("type")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"malformed /generate response: {exc!r} in {str(body)[:300]}") from exc
    if logprob_ids != output_ids:
        raise EngineError(
            f"/generate returned {len(output_ids)} output_ids but logprobs for {len(logprob_ids)} tokens "
            f"({logprob_ids[:8]} vs {output_ids[:8]})"
        )
    reasons = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
    if kind not in reasons:
        raise EngineError(f"/generate returned an unknown finish_reason {finish!r}")
    matched = finish.get("matched") if kind == "stop" and isinstance(finish.get("matched"), (int, str)) else None
    version = str(meta.get("weight_version", ""))
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reasons[kind],
        matched_stop=matched,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        weight_version=int(version) if version.lstrip("-").isdigit() else fallback_version,
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
    )


def map_http_error(exc: httpx.HTTPError, url: str) -> EngineError:
    """The agentrl error for an httpx failure talking to ``url`` (the caller raises it from exc)."""
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(f"{url}: timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        detail = exc.response.text[:500]
        if status >= 500:
            return EngineUnavailable(f"{url}: server error {status}: {detail}")
        if status == 401:
            return EngineError(f"{url}: 401 unauthorized: the server needs its API key (pass api_key=, or set {API_KEY_ENV})")
        return EngineError(f"{url}: request rejected with {status}: {detail}")
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return EngineError(f"{url}: cannot send the request: {exc}")
    if isinstance(exc, httpx.TransportError):
        return EngineUnavailable(f"{url}: unreachable ({type(exc).__name__}: {exc})")
    return EngineError(f"{url}: {type(exc).__name__}: {exc}")


def _retryable(exc: httpx.HTTPError) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError) and not isinstance(
        exc, (httpx.TimeoutException, httpx.UnsupportedProtocol, httpx.LocalProtocolError)
    )


class SGLangClient:
    """One SGLang (or ``agentrl serve``) server over the native HTTP protocol."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ):
        if max_retries < 0 or backoff_s < 0:
            raise ValueError("max_retries and backoff_s must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        headers = auth_headers(api_key or api_key_from_env())
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport, headers=headers)

    async def generate(self, request: GenerateRequest, *, fallback_version: int = 0) -> GenerateResult:
        body = await self._call("POST", "/generate", json=generate_payload(request))
        return parse_generate_response(body, fallback_version=fallback_version)

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", json={"rid": rid}, retries=0, expect_json=False)

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", json={"abort_all": True}, retries=0, expect_json=False)

    async def health(self, timeout_s: float = 5.0) -> bool:
        """GET /health once, without retries."""
        try:
            response = await self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def health_generate(self, timeout_s: float = 60.0) -> bool:
        try:
            response = await self._http.get("/health_generate", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._call("GET", "/get_server_info")

    async def flush_cache(self, *, wait_s: float = 0.0) -> None:
        """Forget the cached prefixes; ``wait_s`` > 0: SGLang waits up to that long for its scheduler
        to be idle (``/flush_cache?timeout=``), else refuses while requests are in it (an EngineError)."""
        await self._call("POST", f"/flush_cache?timeout={wait_s:g}" if wait_s > 0 else "/flush_cache", expect_json=False)

    async def update_weights_from_disk(
        self, path: str, *, weight_version: str | None = None, abort_all_requests: bool = False, flush_wait_s: float = 60.0
    ) -> None:
        """``/update_weights_from_disk``, the prefix cache flushed with it. SGLang refuses the flush
        (after loading the weights) while its scheduler still holds requests the update aborted or
        waited for, which it drops at its next iteration: the flush is then asked again, waiting
        up to ``flush_wait_s`` for the scheduler to be idle."""
        payload = {"model_path": path, "flush_cache": True, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        try:
            await self._control("/update_weights_from_disk", payload)
        except EngineError as exc:
            if "the cache was not flushed" not in str(exc):
                raise
            await self.flush_cache(wait_s=flush_wait_s)

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        await self._control(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str | None = None,
    ) -> None:
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": True,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self._control("/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _control(self, path: str, payload: dict[str, Any]) -> None:
        """A weight/control endpoint answering {success, message}; never retried (not idempotent)."""
        try:
            response = await self._http.post(path, json=payload)
        except httpx.HTTPError as exc:
            raise map_http_error(exc, self.base_url + path) from exc
        try:
            body = response.json()
        except ValueError:
            body = {"success": False, "message": response.text[:500]}
        if response.status_code != 200 or not body.get("success", False):
            raise EngineError(f"{self.base_url}{path} failed ({response.status_code}): {body.get('message')}")

    async def _call(
        self, method: str, path: str, *, json: Any = None, retries: int | None = None, expect_json: bool = True
    ) -> Any:
        retries = self.max_retries if retries is None else retries
        for attempt in itertools.count():
            try:
                response = await self._http.request(method, path, json=json)
                response.raise_for_status()
                return response.json() if expect_json else response.text
            except httpx.HTTPError as exc:
                if attempt >= retries or not _retryable(exc):
                    raise map_http_error(exc, self.base_url + path) from exc
                delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
                log.warning("%s%s failed (%r); retry %d/%d in %.2fs", self.base_url, path, exc, attempt + 1, retries, delay)
                await asyncio.sleep(delay)
            except ValueError as exc:  # the body was not JSON
                raise EngineError(f"{self.base_url}{path}: answer is not JSON: {exc}") from exc
        raise AssertionError("unreachable")

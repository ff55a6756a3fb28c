"""The SGLang backend: an HTTP client for one server and an engine over several.

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

``SGLangEngine`` (the ``Engine`` protocol) spreads requests over several servers: each request
goes to the healthy server with the fewest outstanding requests, except that a trajectory
(``GenerateRequest.session_id``) stays on the server that served its earlier turns while that
server is healthy, so the server's prefix cache holds its history. A server that fails after
its retries is taken out of rotation, the request is retried on another one, and the dead
server is probed with ``/health`` in the background; it rejoins once it answers (after being
brought to the current weights when they came from disk).

Every request carries ``Authorization: Bearer <api_key>`` when the client has a key (``api_key=``,
else ``$AGENTRL_API_KEY``): SGLang's ``--api-key`` and ``agentrl serve`` check it (a 401 says so).

Weight sync: ``update_weights(path=...)`` calls ``/update_weights_from_disk`` on every server
(SGLang drains running requests around it). The NCCL path is ``init_weights_update_group`` +
``update_weights_from_distributed``: this process is rank 0 of a separate process group with the
servers' ranks and broadcasts each tensor, in the announced order, while the HTTP calls that
make the servers receive them are in flight (see ``weight_sync.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import httpx

if TYPE_CHECKING:  # tensors only pass through (weight sync imports torch itself)
    import torch

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.guard import API_KEY_ENV, api_key_from_env, auth_headers
from agentrl.errors import EngineError, EngineTimeout, EngineUnavailable

__all__ = ["SGLangClient", "SGLangEngine", "generate_payload", "parse_generate_response", "map_http_error"]

log = logging.getLogger(__name__)


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

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", expect_json=False)

    async def update_weights_from_disk(
        self, path: str, *, weight_version: str | None = None, abort_all_requests: bool = False
    ) -> None:
        payload = {"model_path": path, "flush_cache": True, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        await self._control("/update_weights_from_disk", payload)

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


@dataclass(eq=False)
class _Server:
    client: SGLangClient
    outstanding: int = 0
    healthy: bool = True
    next_probe_at: float = 0.0
    probing: bool = False
    tp_size: int = 1


class SGLangEngine:
    """Several SGLang servers behind the ``Engine`` protocol (see the module docstring)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        probe_interval_s: float = 2.0,
        max_sessions: int = 100_000,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ):
        """``api_key``: sent to every server (default ``$AGENTRL_API_KEY``); ``launch_servers(...).api_key``."""
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.servers = [
            _Server(SGLangClient(url, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, transport=transport,
                                 api_key=api_key))
            for url in urls
        ]
        self.probe_interval_s = probe_interval_s
        self.max_sessions = max_sessions
        self.weight_version = 0
        self._weights_path: str | None = None  # the latest disk update, to bring a returning server up to date
        self._sessions: OrderedDict[str, _Server] = OrderedDict()
        self._in_flight: dict[str, _Server] = {}
        self._probes: set[asyncio.Task] = set()
        self._group: Any = None
        self._group_name: str | None = None

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.rid is None:
            request = GenerateRequest(request.input_ids, request.sampling, rid=uuid.uuid4().hex, session_id=request.session_id)
        tried: set[int] = set()
        last_error: EngineError | None = None
        while True:
            server = self._pick(request.session_id, exclude=tried)
            if server is None and await self._revive(exclude=tried):
                server = self._pick(request.session_id, exclude=tried)
            if server is None:
                detail = f": {last_error}" if last_error else ""
                raise EngineUnavailable(f"no healthy SGLang server among {[s.client.base_url for s in self.servers]}{detail}")
            tried.add(id(server))
            server.outstanding += 1
            self._in_flight[request.rid] = server
            try:
                return await server.client.generate(request, fallback_version=self.weight_version)
            except EngineUnavailable as exc:
                last_error = exc
                self._take_out(server, exc)
            finally:
                server.outstanding -= 1
                self._in_flight.pop(request.rid, None)

    async def abort(self, rid: str) -> None:
        server = self._in_flight.get(rid)
        targets = [server] if server is not None else [s for s in self.servers if s.healthy]
        await asyncio.gather(*(s.client.abort(rid) for s in targets), return_exceptions=True)

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None, version: int | None = None
    ) -> None:
        """``/update_weights_from_disk`` on every healthy server (SGLang drains requests around it)."""
        if state_dict is not None:
            raise ValueError(
                "SGLang servers cannot take an in-memory state dict over HTTP: save it and pass path=, "
                "or use init_weights_update_group + update_weights_from_distributed (NCCL)"
            )
        if path is None:
            raise ValueError("update_weights needs path= (a checkpoint directory the servers can read)")
        new_version = version if version is not None else self.weight_version + 1
        targets = [s for s in self.servers if s.healthy]
        results = await asyncio.gather(
            *(s.client.update_weights_from_disk(path, weight_version=str(new_version)) for s in targets), return_exceptions=True
        )
        failures = [(s, r) for s, r in zip(targets, results) if isinstance(r, BaseException)]
        for server, error in failures:
            self._take_out(server, error)  # it has stale weights now: it must not serve until resynced
        if len(failures) == len(targets):
            raise EngineUnavailable(f"no server loaded the weights from {path}: {failures[0][1] if failures else 'none healthy'}")
        self.weight_version, self._weights_path = new_version, path

    async def health(self) -> bool:
        checks = await asyncio.gather(*(s.client.health() for s in self.servers))
        return any(checks)

    async def aclose(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await asyncio.gather(*(s.client.aclose() for s in self.servers))

    # ------------------------------------------------------------------ NCCL weight sync

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        backend: str = "nccl",
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
    ) -> None:
        """Form the broadcast group: this process is rank 0, each server's TP ranks follow."""
        from agentrl.engines.weight_sync import init_update_group

        infos = await asyncio.gather(*(s.client.server_info() for s in self.servers))
        for server, info in zip(self.servers, infos):
            server.tp_size = int(info.get("tp_size", 1) or 1)
        offsets = list(itertools.accumulate([1] + [s.tp_size for s in self.servers]))
        world_size = offsets[-1]
        joins = [
            s.client.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
            for s, offset in zip(self.servers, offsets)
        ]
        local = asyncio.to_thread(
            init_update_group,
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        results = await asyncio.gather(local, *joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise EngineError(f"forming weight update group {group_name!r} failed: {errors[0]}") from errors[0]
        self._group, self._group_name = results[0], group_name

    async def update_weights_from_distributed(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        bucket_bytes: int = 512 * 2**20,
    ) -> None:
        """Broadcast the tensors to every server, a bucket (one HTTP call per server) at a time.

        A tied weight must appear once (de-duplicate ``lm_head.weight`` against the embedding).
        """
        from agentrl.engines.weight_sync import broadcast_from_trainer, dtype_name

        if self._group is None:
            raise EngineError("call init_weights_update_group first")
        new_version = version if version is not None else self.weight_version + 1
        buckets = list(_buckets(named_tensors, bucket_bytes))
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            names = [name for name, _ in bucket]
            tensors = [tensor for _, tensor in bucket]
            calls = [
                s.client.update_weights_from_distributed(
                    names=names,
                    dtypes=[dtype_name(t.dtype) for t in tensors],
                    shapes=[list(t.shape) for t in tensors],
                    group_name=self._group_name,
                    weight_version=str(new_version) if last else None,
                )
                for s in self.servers
            ]
            # The servers start receiving when their HTTP call arrives; broadcast while the calls are in flight.
            results = await asyncio.gather(asyncio.to_thread(broadcast_from_trainer, self._group, tensors), *calls, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise EngineError(f"distributed weight update failed on bucket {index}: {errors[0]}") from errors[0]
        self.weight_version = new_version
        self._weights_path = None  # a server that drops out cannot be brought back from disk

    # ------------------------------------------------------------------ routing

    def _pick(self, session_id: str | None, exclude: set[int]) -> _Server | None:
        self._schedule_probes()
        if session_id is not None:
            sticky = self._sessions.get(session_id)
            if sticky is not None and sticky.healthy and id(sticky) not in exclude:
                self._sessions.move_to_end(session_id)
                return sticky
        candidates = [s for s in self.servers if s.healthy and id(s) not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda s: s.outstanding)  # ties: the first listed
        if session_id is not None:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return chosen

    def _take_out(self, server: _Server, error: BaseException) -> None:
        if server.healthy:
            log.warning("taking %s out of rotation: %s", server.client.base_url, error)
        server.healthy = False
        server.next_probe_at = time.monotonic()

    def _schedule_probes(self) -> None:
        now = time.monotonic()
        for server in self.servers:
            if not server.healthy and not server.probing and now >= server.next_probe_at:
                server.probing = True
                task = asyncio.get_running_loop().create_task(self._probe(server))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _revive(self, exclude: set[int]) -> bool:
        """With no server left to try, probe the dead ones now (once) instead of failing at once."""
        dead = [s for s in self.servers if not s.healthy and not s.probing and id(s) not in exclude]
        for server in dead:
            server.probing = True
        await asyncio.gather(*(self._probe(s) for s in dead))
        return any(s.healthy for s in dead)

    async def _probe(self, server: _Server) -> None:
        try:
            if await server.client.health() and await self._resync(server):
                log.warning("%s is back in rotation", server.client.base_url)
                server.healthy = True
        finally:
            server.probing = False
            server.next_probe_at = time.monotonic() + self.probe_interval_s

    async def _resync(self, server: _Server) -> bool:
        """Bring a returning server to the current weights; False if that is impossible."""
        try:
            info = await server.client.model_info()
        except EngineError:
            return False
        if str(info.get("weight_version")) == str(self.weight_version):
            return True
        if self._weights_path is None:
            return self.weight_version == 0 and str(info.get("weight_version")) in ("0", "default")
        try:
            await server.client.update_weights_from_disk(self._weights_path, weight_version=str(self.weight_version))
        except EngineError:
            return False
        return True


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

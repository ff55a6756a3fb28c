"""The SGLang backend: an engine over several servers, each reached by an ``SGLangClient``
(``sglang_client.py``: the native ``/generate`` protocol, retries, the mapping of httpx errors
to ``agentrl.errors``, stop semantics, the API key).

``SGLangEngine`` (the ``Engine`` protocol) spreads requests over several servers: each request
goes to the healthy server with the fewest outstanding requests, except that a trajectory
(``GenerateRequest.session_id``) stays on the server that served its earlier turns while that
server is healthy, so the server's prefix cache holds its history. A server that fails after
its retries is taken out of rotation, the request is retried on another one, and the dead
server is probed with ``/health`` in the background; it rejoins once it answers (after being
brought to the current weights when they came from disk).

Weight sync: ``update_weights(path=...)`` calls ``/update_weights_from_disk`` on every server
(SGLang drains running requests around it). With ``partial=True`` (partial rollouts,
``rollout.partial``) an update does not wait for them: it asks every server to abort its running
requests first (``abort_all_requests``), and each interrupted ``generate`` call, once the update
has finished, is sent again as its prompt plus the tokens sampled so far with what is left of its
``max_new_tokens``; the caller gets one result whose tokens, logprobs and per-token weight
versions join the pieces (``output_versions``), whatever the number of interruptions. Requests
wait while an update runs. A request aborted by the caller (``abort``), or by the server with no
update under way, is not resumed. A stop string split across an interruption is not seen by the
server (it matches within one piece); stop tokens are. Each piece carries the request's seed:
SGLang's seeded sampling (``--enable-deterministic-inference``) draws by seed and position, so a
resumed piece draws what the uninterrupted request would have given the same logits (`agentrl
serve` starts the request's random stream again instead). The NCCL path is ``init_weights_update_group`` +
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import httpx

if TYPE_CHECKING:  # tensors only pass through (weight sync imports torch itself)
    import torch

from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.sglang_client import SGLangClient, generate_payload, map_http_error, parse_generate_response
from agentrl.errors import EngineError, EngineUnavailable

__all__ = ["SGLangClient", "SGLangEngine", "generate_payload", "parse_generate_response", "map_http_error"]

log = logging.getLogger(__name__)


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
        partial: bool = False,
    ):
        """``api_key``: sent to every server (default ``$AGENTRL_API_KEY``); ``launch_servers(...).api_key``.
        ``partial``: a weight update interrupts running requests, which resume under the new weights
        (see the module docstring)."""
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
        self.partial = partial
        self.interrupted_requests = 0  # generate calls a weight update interrupted (partial rollouts)
        self.resumed_requests = 0  # ... and sent again under the new weights
        self._updates_begun = 0  # weight updates started: an abort during one of them is an interruption
        self._admitting = asyncio.Event()  # cleared while an update runs: no request is sent meanwhile
        self._admitting.set()
        self._wire_rids: dict[str, str] = {}  # caller's rid -> the rid of the piece on a server now
        self._resumable: set[str] = set()  # caller's rids of the generate calls that resume after an update
        self._cancelled: set[str] = set()  # ... of those the caller aborted: not resumed
        self._sync_pending: dict[str, str] = {}  # server URL -> the call of the running weight sync it has not answered

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.rid if request.rid is not None else uuid.uuid4().hex
        if not self.partial:
            return await self._send(replace(request, rid=rid), rid)
        sampling = request.sampling
        output_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        first: GenerateResult | None = None
        pieces = 0
        self._resumable.add(rid)
        try:
            while True:
                await self._admitting.wait()
                if pieces and rid in self._cancelled:  # the caller aborted it while it waited to resume
                    finish = FinishReason.ABORT
                    break
                updates = self._updates_begun
                wire = GenerateRequest(request.input_ids + output_ids,
                                       replace(sampling, max_new_tokens=sampling.max_new_tokens - len(output_ids)),
                                       rid=rid if pieces == 0 else f"{rid}#{pieces}", session_id=request.session_id)
                if pieces:
                    self.resumed_requests += 1
                result = await self._send(wire, rid)
                first = first or result
                output_ids += result.output_ids
                logprobs += result.logprobs
                versions += result.token_versions()
                finish = result.finish_reason
                if finish is not FinishReason.ABORT or self._updates_begun == updates or rid in self._cancelled:
                    break
                self.interrupted_requests += 1  # aborted by the update: resume it once the update is done
                if output_ids and output_ids[-1] in sampling.stop_token_ids:  # the abort came with its last token
                    finish = FinishReason.STOP
                    break
                if len(output_ids) >= sampling.max_new_tokens:
                    finish = FinishReason.LENGTH
                    break
                pieces += 1
        finally:
            self._resumable.discard(rid)
            self._cancelled.discard(rid)
        assert first is not None
        matched = result.matched_stop if finish is result.finish_reason else (output_ids[-1] if finish is FinishReason.STOP else None)
        return GenerateResult(
            output_ids=output_ids, logprobs=logprobs, finish_reason=finish, matched_stop=matched,
            prompt_tokens=first.prompt_tokens, weight_version=result.weight_version, cached_tokens=first.cached_tokens,
            output_versions=versions if len(set(versions)) > 1 else [],
        )

    async def _send(self, request: GenerateRequest, rid: str) -> GenerateResult:
        """One request to one server, failing over to the others (``rid``: the caller's id, to abort it)."""
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
            self._in_flight[rid] = server
            self._wire_rids[rid] = request.rid or rid
            try:
                return await server.client.generate(request, fallback_version=self.weight_version)
            except EngineUnavailable as exc:
                last_error = exc
                self._take_out(server, exc)
            finally:
                server.outstanding -= 1
                self._in_flight.pop(rid, None)
                self._wire_rids.pop(rid, None)

    async def abort(self, rid: str) -> None:
        server = self._in_flight.get(rid)
        if rid in self._resumable:
            self._cancelled.add(rid)
        wire = self._wire_rids.get(rid, rid)
        targets = [server] if server is not None else [s for s in self.servers if s.healthy]
        await asyncio.gather(*(s.client.abort(wire) for s in targets), return_exceptions=True)

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None, version: int | None = None
    ) -> None:
        """``/update_weights_from_disk`` on every healthy server (SGLang drains requests around it;
        with ``partial`` they are aborted first and resume afterwards, see the module docstring)."""
        if state_dict is not None:
            raise ValueError(
                "SGLang servers cannot take an in-memory state dict over HTTP: save it and pass path=, "
                "or use init_weights_update_group + update_weights_from_distributed (NCCL)"
            )
        if path is None:
            raise ValueError("update_weights needs path= (a checkpoint directory the servers can read)")
        new_version = version if version is not None else self.weight_version + 1
        targets = [s for s in self.servers if s.healthy]
        self._updates_begun += 1
        self._admitting.clear()
        try:
            results = await asyncio.gather(
                *(self._sync_call(s, s.client.update_weights_from_disk(path, weight_version=str(new_version),
                                                                         abort_all_requests=self.partial),
                                  "/update_weights_from_disk") for s in targets),
                return_exceptions=True,
            )
        finally:
            self._sync_pending.clear()
            self._admitting.set()
        failures = [(s, r) for s, r in zip(targets, results) if isinstance(r, BaseException)]
        for server, error in failures:
            self._take_out(server, error)  # it has stale weights now: it must not serve until resynced
        if len(failures) == len(targets):
            raise EngineUnavailable(f"no server loaded the weights from {path}: {failures[0][1] if failures else 'none healthy'}")
        self.weight_version, self._weights_path = new_version, path

    async def _sync_call(self, server: _Server, call: Any, endpoint: str) -> None:
        url = server.client.base_url
        self._sync_pending[url] = endpoint
        try:
            await call
        finally:
            self._sync_pending.pop(url, None)

    def sync_waiting(self) -> str:
        """What the running weight sync waits for: the servers that have not answered, with this
        engine's requests on each (a server without partial rollouts drains them first)."""
        if not self._sync_pending:
            return "no server call pending"
        parts = []
        for server in self.servers:
            endpoint = self._sync_pending.get(server.client.base_url)
            if endpoint is not None:
                parts.append(f"{server.client.base_url}{endpoint} not answered, "
                             f"{server.outstanding} requests of this engine running there")
        return "; ".join(parts)

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

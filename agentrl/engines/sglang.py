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
update under way, is not resumed. A server checks stop strings against its piece's text only, so
the client checks the joined output (with ``tokenizer``) where a piece begins: a stop string begun
before an interruption and completed after it ends the request at its completing token, as an
uninterrupted request would have ended (what the server sampled past it is dropped); and when
the output so far ends inside a possible stop string, the resumed piece is a short one first
(``StopStrings.window`` tokens), so a stop missed by the server costs those few tokens. Each
piece carries the request's seed: SGLang's seeded sampling (``--enable-deterministic-inference``)
draws by seed and position, so a resumed piece draws what the uninterrupted request would have
given the same logits (`agentrl serve` starts the request's random stream again instead).

The NCCL path is ``init_weights_update_group`` + ``update_weights_from_distributed``: this
process is rank 0 of a separate process group with the servers' ranks and broadcasts each
tensor, in the announced order, while the HTTP calls that make the servers receive them are in
flight (see ``weight_sync.py``).
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
from agentrl.engines.stops import StopStrings
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
        tokenizer: Any = None,
    ):
        """``api_key``: sent to every server (default ``$AGENTRL_API_KEY``); ``launch_servers(...).api_key``.
        ``partial``: a weight update interrupts running requests, which resume under the new weights
        (see the module docstring). ``tokenizer``: the served model's (its ``decode``), which
        partial rollouts need for requests with stop strings."""
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
        self.tokenizer = tokenizer
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
        stops = self._stop_strings(sampling.stop)
        output_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        first: GenerateResult | None = None
        pieces = 0
        interrupted = False  # the last piece was cut by a weight update: the next one resumes it
        self._resumable.add(rid)
        try:
            while True:
                while not self._admitting.is_set():  # woken by one update's end, it may find the next one begun
                    await self._admitting.wait()
                if pieces and rid in self._cancelled:  # the caller aborted it while it waited to resume
                    finish, matched = FinishReason.ABORT, None
                    break
                updates = self._updates_begun
                budget = sampling.max_new_tokens - len(output_ids)
                # a stop string may be under way at the boundary, which the server would not see
                # completed: a short piece first, checked here on the joined output, so that a
                # missed stop costs a few tokens, not the rest of the budget
                short = stops is not None and pieces > 0 and budget > stops.window and stops.open_at_end(output_ids)
                wire = GenerateRequest(request.input_ids + output_ids,
                                       replace(sampling, max_new_tokens=stops.window if short else budget),
                                       rid=rid if pieces == 0 else f"{rid}#{pieces}", session_id=request.session_id)
                if interrupted:
                    self.resumed_requests += 1
                result = await self._send(wire, rid)
                first = first or result
                start = len(output_ids)
                output_ids += result.output_ids
                logprobs += result.logprobs
                versions += result.token_versions()
                finish, matched = result.finish_reason, result.matched_stop
                interrupted = finish is FinishReason.ABORT and self._updates_begun != updates and rid not in self._cancelled
                if interrupted:
                    self.interrupted_requests += 1  # aborted by the update: resume it once the update is done
                if stops is not None and (hit := _missed_stop(stops, output_ids, start, interrupted)) is not None:
                    end, matched = hit[0] + 1, hit[1]
                    del output_ids[end:], logprobs[end:], versions[end:]  # sampled past the stop: not the request's
                    finish = FinishReason.STOP
                    break
                if interrupted:
                    if output_ids and output_ids[-1] in sampling.stop_token_ids:  # the abort came with its last token
                        finish, matched = FinishReason.STOP, output_ids[-1]
                        break
                    if len(output_ids) >= sampling.max_new_tokens:
                        finish, matched = FinishReason.LENGTH, None
                        break
                elif not (short and finish is FinishReason.LENGTH):
                    break
                pieces += 1
        finally:
            self._resumable.discard(rid)
            self._cancelled.discard(rid)
        assert first is not None
        return GenerateResult(
            output_ids=output_ids, logprobs=logprobs, finish_reason=finish, matched_stop=matched,
            prompt_tokens=first.prompt_tokens, weight_version=versions[-1] if versions else result.weight_version,
            cached_tokens=first.cached_tokens, output_versions=versions if len(set(versions)) > 1 else [],
        )

    def _stop_strings(self, stop: tuple[str, ...]) -> StopStrings | None:
        """The request's stop strings over the tokenizer, to check them across interruptions."""
        if not stop:
            return None
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise EngineError("stop strings with partial rollouts need the model's tokenizer, to find a stop string "
                              "split across an interruption: pass SGLangEngine(..., tokenizer=...)")
        return StopStrings(stop, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

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

    async def served_weight_version(self) -> int | None:
        """The lowest weight version the healthy servers report holding (``/get_model_info``),
        not the one this client sent; None when none reports a number."""
        infos = await asyncio.gather(*(s.client.model_info() for s in self.servers if s.healthy), return_exceptions=True)
        found = [str(i.get("weight_version", "")) for i in infos if isinstance(i, dict)]
        numbers = [int(v) for v in found if v.lstrip("-").isdigit()]
        return min(numbers) if numbers else None

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


def _missed_stop(stops: StopStrings, output_ids: list[int], start: int, interrupted: bool) -> tuple[int, str] | None:
    """Where the joined output completes a stop string that its server could not see: one begun
    before the piece that starts at ``start`` (its first ``stops.window`` tokens), or one that
    the piece's last token completed as an update aborted it."""
    positions = list(range(start, min(start + stops.window, len(output_ids)))) if start else []
    if interrupted and output_ids and (not positions or positions[-1] < len(output_ids) - 1):
        positions.append(len(output_ids) - 1)
    return stops.first_completed(output_ids, positions)


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

"""The built-in engine: a transformers causal LM serving many concurrent requests, continuously batched.

How a step works (callers only ``await`` futures; the steps run on a background thread, or, with
``steps_on="event_loop"``, on the callers' event loop, see "Where the steps run" below):

1. take new requests, aborts and weight updates handed over by ``generate`` / ``abort`` /
   ``update_weights``;
2. admit waiting requests while there are free slots (up to ``max_batch_size``) and the step's
   prefill budget (``max_prefill_tokens``) lasts; a request that arrives while others decode is
   admitted at the next step, without waiting for them to finish;
3. run one forward over the packed tokens: one decode token per running request followed by the
   prompts of the admitted ones (see ``_ragged.py``: no padding, K/V written in place);
4. sample one token per request with its own temperature / top-p / top-k and its own seeded
   ``torch.Generator`` (``sampling.py``), stop on a stop token (kept in the output, like SGLang),
   on ``max_new_tokens`` or when the context reaches ``max_seq_len``.

Prefix reuse: a finished request leaves its K/V in its slot. A new request whose tokens start
with a retained slot's tokens (the next turn of a conversation, another sample of the same
prompt, a shared system prompt) reuses them: it takes the slot over when it extends all of it,
otherwise it copies the shared prefix, and only the rest is prefilled. A running request's slot
lends its prefix the same way (by copy), and so does a request admitted in the same step: a
request that shares more tokens with one admitted alongside it than with any cached slot copies
them inside the step, layer by layer, right after they are computed (``_ragged.PrefixCopy``), so
the n samples of a GRPO group that arrive together compute their prompt once, in one step. The
reused count is reported as ``cached_tokens`` (as SGLang reports its radix-cache hits).

Why a hand-written scheduler: transformers 5.23's own continuous batching
(``model.generate_batch`` / ``init_continuous_batching``) was measured on this CPU with the 1M and
18M tiny models slower than even a static-batch ``model.generate`` of the same requests (figures
in docs/benchmarks.md); it also has no per-request seed (one global ``torch.multinomial``) and a
single greedy/sampling switch for the whole batch.

Weight updates drain: once an update is requested no request is admitted, the running ones
finish under the old weights, the new weights are copied in place, retained prefixes are
dropped (their K/V belong to the old weights), ``weight_version`` moves on and admission resumes.
So every result is produced by exactly one weight version, which it reports.

Where the steps run: by default on a background thread, so the caller's event loop stays free
(``agentrl serve`` parses HTTP while the engine steps). ``steps_on="event_loop"`` runs them as a
task on the event loop of the caller that brought work, between the other tasks; for a process
whose torch work happens on one thread anyway (the trainer's actor: rollout, then update) this is
measured much faster: a second thread doing torch work gets a second OpenMP thread team, and
libgomp stops spin-waiting when it manages more threads than there are cores, so each of the
hundreds of small parallel regions of a step then pays a sleep and wake-up (a decode forward on
a second thread, measured: docs/benchmarks.md). Either way the worker parks when idle: the
thread exits after ``idle_exit_s``, the task ends at once, and the next call starts it again. A
task whose event loop closes with work left (``asyncio.run`` returning while another loop still
waits on a request) hands the work to a thread.

Logprobs follow SGLang (see ``sampling.py``): ``log_softmax(logits / temperature)`` of the sampled
token, before top-k / top-p; ``log_softmax(logits)`` when greedy.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from agentrl.engines import _ragged
from agentrl.engines._packed import make_forward
from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.sampling import sample_next_tokens
from agentrl.engines.weights import copy_weights_into, read_checkpoint
from agentrl.errors import EngineError, EngineUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BuiltinEngine", "EngineStats", "StepRecord"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PARTIAL_PREFIX_CANDIDATES = 8  # slots examined for a partial prefix match per admission


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did (kept in ``BuiltinEngine.step_log``)."""

    step: int
    started: float  # time.perf_counter() when the step began
    ended: float  # ... and when its tokens were sampled
    decode_rids: tuple[str, ...]  # requests that decoded one token
    prefill_rids: tuple[str, ...]  # requests admitted (prefilled, first token sampled)
    finished_rids: tuple[str, ...]
    prefill_tokens: int  # prompt tokens computed this step
    reused_tokens: int  # prompt tokens whose K/V came from another slot (retained, running or admitted alongside)


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
    generated_tokens: int
    prefill_tokens: int
    reused_tokens: int
    weight_version: int
    kv_cache_bytes: int


@dataclass(eq=False, slots=True)
class _Sequence:
    rid: str
    request: GenerateRequest
    tokens: list[int]  # prompt followed by the sampled tokens
    stop_ids: frozenset[int]
    generator: torch.Generator
    resolve: Callable[[GenerateResult | BaseException], None]
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the slot
    reused: int = 0  # prompt tokens whose K/V came from another slot (not computed for this request)
    prefilled: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _WeightUpdate:
    state_dict: Mapping[str, torch.Tensor] | None  # neither this nor path: changed in place (shared module)
    path: str | None
    version: int | None
    strict: bool
    resolve: Callable[[object], None]


class _Slots:
    """Which KV slots are free, and which free ones still hold a finished request's K/V."""

    def __init__(self, cache: _ragged.SlotKVCache):
        self.cache = cache
        self.empty = list(range(cache.slots))  # heap: the lowest slot first keeps the decode span short
        self.retained: OrderedDict[int, list[int]] = OrderedDict()  # slot -> its cached tokens, LRU first

    def acquire(self, donor: int | None, shared: int) -> tuple[int, int]:
        """A slot for a request whose first ``shared`` tokens have K/V in slot ``donor`` (found by
        ``best_prefix``), and how many leading tokens have K/V in the returned slot. A running
        request's slot lends its prefix by copy but is never taken over."""
        if donor in self.retained and shared >= len(self.retained[donor]):
            del self.retained[donor]  # the request extends everything the slot holds: take it over
            return donor, shared
        slot = self._take_free(avoid=donor if donor in self.retained else None)
        if donor is None:
            return slot, 0
        if slot != donor:
            self.cache.copy_prefix(donor, slot, shared)
        return slot, shared  # (slot == donor when it was the only slot left: its K/V are still there)

    def release(self, slot: int, cached_tokens: list[int]) -> None:
        if cached_tokens:
            self.retained[slot] = cached_tokens
        else:
            heapq.heappush(self.empty, slot)

    def drop_retained(self) -> None:
        for slot in self.retained:
            heapq.heappush(self.empty, slot)
        self.retained.clear()

    def _take_free(self, avoid: int | None) -> int:
        if self.empty:
            return heapq.heappop(self.empty)
        for slot in self.retained:  # evict the least recently used retained slot
            if slot != avoid:
                del self.retained[slot]
                return slot
        del self.retained[avoid]
        return avoid

    def best_prefix(self, tokens: list[int], live: dict[int, list[int]]) -> tuple[int | None, int]:
        """The slot holding the longest prefix of ``tokens``, and its length. ``live``: running
        requests' slots and the tokens whose K/V they hold."""
        limit = len(tokens) - 1  # at least one token must be computed to get next-token logits
        # A retained slot whose whole content starts the request (the next turn of its conversation)
        # is the common case; one C-level list comparison per slot finds it.
        best, best_len = None, 0
        for slot, cached in self.retained.items():
            if best_len < len(cached) <= limit and tokens[: len(cached)] == cached:
                best, best_len = slot, len(cached)
        if best is not None:
            return best, best_len
        # Otherwise a partial prefix (another sample of the same prompt, a shared system prompt):
        # measure it on the most recent slots that share at least the first tokens.
        return _longest_shared(tokens, [*live.items(), *reversed(self.retained.items())], limit)


def _resolve_copy(
    dst: int, src: int, length: int, copied_from: dict[int, tuple[int, int]]
) -> list[_ragged.PrefixCopy]:
    """Copies that give ``dst`` the first ``length`` positions of ``src`` inside one step, taking
    each position from where it is written: a source that itself copied its first positions in
    this step (from its own leader) passes those on from that leader, since all copies of a step
    read the cache at once."""
    if src not in copied_from:
        return [_ragged.PrefixCopy(dst, src, 0, length)]
    origin, copied = copied_from[src]
    head = _resolve_copy(dst, origin, min(length, copied), copied_from)
    return head + ([_ragged.PrefixCopy(dst, src, copied, length)] if length > copied else [])


def _longest_shared(tokens: list[int], holders: list[tuple[int, list[int]]], limit: int) -> tuple[int | None, int]:
    """Among ``(key, tokens)`` holders that start like ``tokens``, the one sharing the longest
    prefix (at most ``limit``) and that length; only the first few candidates are measured."""
    best, best_len = None, 0
    probe = min(4, limit)
    if not probe:
        return best, best_len
    head = tokens[:probe]
    candidates = [(key, held) for key, held in holders if held[:probe] == head]
    for key, held in candidates[:_PARTIAL_PREFIX_CANDIDATES]:
        shared = _common_prefix(held, tokens, limit)
        if shared > best_len:
            best, best_len = key, shared
    return best, best_len


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b (at most ``limit``), by bisection on slice equality."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    return bisect.bisect_left(range(hi), True, key=lambda n: a[: n + 1] != b[: n + 1])


class BuiltinEngine:
    """Continuous-batching engine over a transformers causal LM (the ``Engine`` protocol).

    ``model``: a checkpoint directory or a loaded ``PreTrainedModel``, used as is, not copied (the
    engine sets its attention implementation to the ragged one; plain calls to the model keep
    working through the SDPA fallback): a colocated trainer can hand over its own module and call
    ``weights_changed`` after each update instead of copying weights. Decoder-only models whose
    forward accepts a precomputed mask mapping (Qwen2, Qwen3) are supported.
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 2048,
        seed: int = 0,
        step_log_size: int | None = 1024,
        idle_exit_s: float = 0.02,
        steps_on: str = "thread",
    ):
        if steps_on not in ("thread", "event_loop"):
            raise ValueError(f"steps_on must be 'thread' or 'event_loop', got {steps_on!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = torch.device(device)
        self.model = _load_model(model, torch_dtype, self.device)
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_seq_len: int = max_seq_len or config.max_position_embeddings
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self._forward = make_forward(self.model, self.max_seq_len)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._cache = _ragged.SlotKVCache(
            num_layers=config.num_hidden_layers,
            slots=max_batch_size,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_len=self.max_seq_len,
            dtype=torch_dtype,
            device=self.device,
        )
        self._slots = _Slots(self._cache)
        self._seed_source = torch.Generator().manual_seed(seed)
        self.weight_version = 0
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_size)
        self._counters = {"steps": 0, "generated": 0, "prefill": 0, "reused": 0}
        # Shared with the caller threads, guarded by _cv.
        self._cv = threading.Condition()
        self._inbox: list[_Sequence] = []
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._updates: list[_WeightUpdate] = []
        self._closed = False
        self._flush_requested = False
        # Owned by the worker (the thread or task that runs the steps).
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._fatal: BaseException | None = None
        # The worker thread exits after ``idle_exit_s`` without work and the next call starts it
        # again. Measured (docs/benchmarks.md): a colocated trainer's update (hundreds of small
        # ops) ran slower while this thread idled, and as fast as with no engine once it had exited. The
        # likely cause: an idle thread that has run torch ops keeps an OpenMP thread team, and
        # libgomp cuts its spin-waiting short when it manages more threads than there are cores.
        self._idle_exit_s = idle_exit_s
        self.steps_on = steps_on
        self._worker: threading.Thread | asyncio.Task | None = None
        if steps_on == "thread":
            with self._cv:
                self._wake()

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> "BuiltinEngine":
        """Load a ``save_pretrained`` directory; keyword arguments as for the constructor."""
        return cls(path, **kwargs)

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._validate(request)
        sampling = request.sampling
        prompt_tokens = len(request.input_ids)
        if sampling.max_new_tokens == 0:
            return GenerateResult([], [], FinishReason.LENGTH, prompt_tokens=prompt_tokens, weight_version=self.weight_version)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        rid = request.rid or uuid.uuid4().hex
        seed = sampling.seed
        with self._cv:
            if self._closed:
                raise EngineUnavailable("the built-in engine is closed")
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            sequence = _Sequence(
                rid=rid,
                request=request,
                tokens=list(request.input_ids),
                stop_ids=frozenset(sampling.stop_token_ids),
                generator=torch.Generator().manual_seed(seed),
                resolve=_resolver(loop, future),
            )
            self._inbox.append(sequence)
            self._wake()
        try:
            return await future
        except asyncio.CancelledError:
            await self.abort(rid)
            raise

    async def abort(self, rid: str) -> None:
        """Abort a waiting or running request; it returns with finish reason ABORT. Unknown ids are ignored."""
        with self._cv:
            self._abort_rids.add(rid)
            self._wake()

    async def abort_all(self) -> None:
        with self._cv:
            self._abort_all = True
            self._wake()

    async def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        *,
        path: str | None = None,
        version: int | None = None,
        strict: bool = True,
    ) -> None:
        """Copy new weights in place (drains running requests first); bumps ``weight_version``.

        ``version`` sets the new version (default: the current one + 1). ``strict=False`` accepts
        a state dict covering only some parameters (one bucket of a streamed update).
        """
        if (state_dict is None) == (path is None):
            raise ValueError("update_weights needs exactly one of state_dict or path")
        await self._queue_update(state_dict, str(path) if path is not None else None, version, strict)

    async def weights_changed(self, *, version: int | None = None) -> None:
        """The model's parameters were changed in place by the module's other owner (a colocated
        trainer that passed its own model to the engine): nothing is copied; the retained
        prefixes are dropped (their K/V came from the old weights) and ``weight_version`` moves
        on. Only valid between requests: a request running while its weights changed would mix
        two versions, so that is refused."""
        if self.stats().running:
            raise RuntimeError("weights_changed while requests are running: their tokens would mix two weight versions")
        await self._queue_update(None, None, version, False)

    async def _queue_update(
        self, state_dict: Mapping[str, torch.Tensor] | None, path: str | None, version: int | None, strict: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        with self._cv:
            if self._closed:
                raise EngineUnavailable("the built-in engine is closed")
            self._updates.append(_WeightUpdate(state_dict, path, version, strict, _resolver(loop, future)))
            self._wake()
        await future

    @property
    def worker_running(self) -> bool:
        """Whether the worker (thread or event-loop task) is up; it parks when idle."""
        with self._cv:
            return self._worker is not None and not self._closed

    async def health(self) -> bool:
        return not self._closed and self._fatal is None  # a parked worker is started on demand

    # ------------------------------------------------------------------ extras

    async def flush_cache(self) -> None:
        """Forget retained prefixes (running requests are not affected)."""
        with self._cv:
            self._flush_requested = True
            self._wake()

    def stats(self) -> EngineStats:
        return EngineStats(
            steps=self._counters["steps"],
            running=len(self._running),
            waiting=len(self._waiting) + len(self._inbox),
            generated_tokens=self._counters["generated"],
            prefill_tokens=self._counters["prefill"],
            reused_tokens=self._counters["reused"],
            weight_version=self.weight_version,
            kv_cache_bytes=self._cache.nbytes(),
        )

    def close(self) -> None:
        """Stop the worker; requests still queued or running fail with EngineUnavailable."""
        with self._cv:
            self._closed = True
            worker = self._worker
            self._cv.notify()
        if worker is None:  # parked: nothing was queued or running
            self._fail_all(EngineUnavailable("the built-in engine is closed"))
        elif isinstance(worker, threading.Thread) and worker is not threading.current_thread():
            worker.join()
        # an event-loop task sees the flag at its next step and fails what is left

    async def __aenter__(self) -> "BuiltinEngine":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------ validation

    def _validate(self, request: GenerateRequest) -> None:
        ids = request.input_ids
        if not ids:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"input_ids has {len(ids)} tokens; max_seq_len is {self.max_seq_len}, leaving no room to generate"
            )
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise ValueError(f"input_ids[{bad}] = {ids[bad]} is outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ the worker

    def _wake(self) -> None:
        """Signal the worker, starting it if it is parked (the caller holds ``_cv``)."""
        if self._worker is None and not self._closed:
            loop = None
            if self.steps_on == "event_loop":
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    pass  # called outside an event loop: a thread takes the work
            if loop is not None:
                self._worker = loop.create_task(self._serve_on_loop(), name="agentrl-builtin-engine")
            else:
                self._start_thread()
        self._cv.notify()

    def _start_thread(self) -> None:
        self._worker = threading.Thread(target=self._run, name="agentrl-builtin-engine", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        try:
            parked = self._serve()
        except BaseException as exc:  # a bug or an out-of-memory: fail everyone, keep the cause
            self._fatal = exc
            self._shut_down()
            raise
        if not parked:
            self._shut_down()

    def _serve(self) -> bool:
        """Run steps until the engine is closed (returns False) or idle for ``idle_exit_s`` (True)."""
        while True:
            with self._cv:
                while not self._closed and not self._has_work():
                    if not self._cv.wait(timeout=self._idle_exit_s) and not self._has_work() and not self._closed:
                        self._worker = None  # parked: the next call starts a new thread
                        return True
                if self._closed:
                    return False
                work = self._take_work()
            self._work(*work)

    async def _serve_on_loop(self) -> None:
        """The event-loop worker: one step per turn of the loop, ends as soon as there is no work."""
        try:
            while True:
                with self._cv:
                    if self._closed:
                        break
                    if not self._has_work():
                        self._worker = None  # parked: the next call starts a new task
                        return
                    work = self._take_work()
                self._work(*work)
                await asyncio.sleep(0)  # let the callers run and bring their next requests
        except asyncio.CancelledError:  # the loop is closing (asyncio.run returned)
            with self._cv:
                self._worker = None
                closed = self._closed
                if not closed and self._has_work():
                    self._start_thread()  # callers on other loops still wait
            if closed:
                self._shut_down()
            raise
        except BaseException as exc:  # a bug or an out-of-memory: fail everyone, keep the cause
            self._fatal = exc
            logger.error("the built-in engine stopped", exc_info=exc)
        self._shut_down()

    def _take_work(self) -> tuple[set[str], bool, bool, list[_WeightUpdate]]:
        """Move what callers handed over to the worker's side (the caller holds ``_cv``)."""
        self._waiting.extend(self._inbox)
        self._inbox.clear()
        aborts, self._abort_rids = self._abort_rids, set()
        abort_all, self._abort_all = self._abort_all, False
        flush, self._flush_requested = self._flush_requested, False
        updates = list(self._updates) if not self._running else []
        if updates:
            self._updates.clear()
        return aborts, abort_all, flush, updates

    def _work(self, aborts: set[str], abort_all: bool, flush: bool, updates: list[_WeightUpdate]) -> None:
        """Apply aborts, a cache flush and weight updates, then run one step if anything runs."""
        if aborts or abort_all:
            self._apply_aborts(aborts, abort_all)
        if flush:
            self._slots.drop_retained()
        for update in updates:
            self._apply_update(update)
        if self._updates_pending():
            admitted, copies = [], []  # drain: running requests finish under the current weights
        else:
            admitted, copies = self._admit()
        if self._running:
            self._step(admitted, copies)

    def _shut_down(self) -> None:
        with self._cv:
            self._closed = True  # later calls fail at once instead of waiting on a dead worker
        self._fail_all(EngineUnavailable(f"the built-in engine stopped: {self._fatal!r}" if self._fatal else "the built-in engine is closed"))

    def _has_work(self) -> bool:
        admissible = bool(self._waiting) and not self._updates  # an update holds back admission
        return bool(
            self._inbox or self._running or admissible or self._updates
            or self._abort_rids or self._abort_all or self._flush_requested
        )  # fmt: skip

    def _updates_pending(self) -> bool:
        with self._cv:
            return bool(self._updates)

    def _apply_aborts(self, rids: set[str], everything: bool) -> None:
        hit = lambda seq: everything or seq.rid in rids  # noqa: E731
        for seq in [s for s in self._waiting if hit(s)]:
            self._waiting.remove(seq)
            seq.resolve(self._result(seq, FinishReason.ABORT))
        for seq in [s for s in self._running if hit(s)]:
            self._finish(seq, FinishReason.ABORT)

    def _apply_update(self, update: _WeightUpdate) -> None:
        self._forward.weights_changed()  # before the copy: a failed copy may have written some
        try:
            if update.state_dict is not None:
                copy_weights_into(self.model, update.state_dict, strict=update.strict)
            elif update.path is not None:
                copy_weights_into(self.model, read_checkpoint(update.path), strict=update.strict)
        except Exception as exc:  # a bad update is the caller's error to hear: it must not end the engine's worker
            update.resolve(exc)
            return
        self._slots.drop_retained()
        self.weight_version = update.version if update.version is not None else self.weight_version + 1
        update.resolve(None)

    def _admit(self) -> tuple[list[_Sequence], list[_ragged.PrefixCopy]]:
        """Requests that join this step, and the prefixes they copy from others joining with them."""
        admitted: list[_Sequence] = []
        copies: list[_ragged.PrefixCopy] = []
        copied_from: dict[int, tuple[int, int]] = {}  # slot -> (source slot, length) of its in-step copy
        budget = self.max_prefill_tokens
        live = {seq.slot: seq.tokens[: seq.cached] for seq in self._running if seq.prefilled} if self._waiting else {}
        while self._waiting and len(self._running) < self.max_batch_size:
            seq = self._waiting[0]
            if admitted and len(seq.tokens) > budget:
                break  # a long prompt waits for the next step rather than stretching this one
            self._waiting.popleft()
            donor, available = self._slots.best_prefix(seq.tokens, live)
            leader, in_step = _longest_shared(seq.tokens, [(s.slot, s.tokens) for s in reversed(admitted)], len(seq.tokens) - 1)
            if in_step > available:  # K/V computed (or copied) for the leader in this very step
                seq.slot, _ = self._slots.acquire(None, 0)
                copied_from[seq.slot] = (leader, in_step)
                copies.extend(_resolve_copy(seq.slot, leader, in_step, copied_from))
                seq.reused = in_step
            else:
                seq.slot, seq.reused = self._slots.acquire(donor, available)
            seq.cached = seq.reused
            budget -= len(seq.tokens) - seq.reused
            self._running.append(seq)
            admitted.append(seq)
        return admitted, copies

    @torch.inference_mode()
    def _step(self, admitted: list[_Sequence], copies: list[_ragged.PrefixCopy]) -> None:
        started = time.perf_counter()
        decoding = [seq for seq in self._running if seq.prefilled]
        packed: list[int] = [seq.tokens[-1] for seq in decoding]
        positions: list[int] = [seq.cached for seq in decoding]
        logit_rows = list(range(len(decoding)))
        prefills: list[_ragged.PrefillSpan] = []
        for seq in admitted:
            prompt = seq.tokens[seq.cached :]
            prefills.append(_ragged.PrefillSpan(seq.slot, seq.cached, len(prompt), len(packed)))
            packed.extend(prompt)
            positions.extend(range(seq.cached, len(seq.tokens)))
            logit_rows.append(len(packed) - 1)
        self._cache.ensure_capacity(max(positions) + 1)
        layout = _ragged.build_layout(
            self._cache, [s.slot for s in decoding], positions[: len(decoding)], tuple(prefills), self.device, tuple(copies)
        )
        stepping = decoding + admitted
        try:
            tokens, logprobs = self._forward_and_sample(stepping, packed, positions, logit_rows, layout)
        except (RuntimeError, ValueError) as exc:  # fail this step's requests, keep serving the rest
            for seq in stepping:
                self._finish(seq, error=EngineError(f"generation failed for request {seq.rid}: {exc}"))
            return
        finished: list[tuple[_Sequence, GenerateResult]] = []
        for seq, token, logprob in zip(stepping, tokens, logprobs):
            seq.cached = len(seq.tokens)
            seq.prefilled = True
            seq.tokens.append(token)
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            # Length is checked before stop tokens, as SGLang does: a stop token sampled as the
            # last allowed token ends the request with reason LENGTH.
            if len(seq.output_ids) >= seq.request.sampling.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
                reason, matched = FinishReason.LENGTH, None
            elif token in seq.stop_ids:
                reason, matched = FinishReason.STOP, token
            else:
                continue
            self._release(seq)
            finished.append((seq, self._result(seq, reason, matched)))
        prefill_tokens = sum(p.length for p in prefills)
        reused = sum(seq.reused for seq in admitted)
        counters = self._counters
        counters["steps"] += 1
        counters["generated"] += len(stepping)
        counters["prefill"] += prefill_tokens
        counters["reused"] += reused
        self.step_log.append(
            StepRecord(
                step=counters["steps"],
                started=started,
                ended=time.perf_counter(),
                decode_rids=tuple(s.rid for s in decoding),
                prefill_rids=tuple(s.rid for s in admitted),
                finished_rids=tuple(seq.rid for seq, _ in finished),
                prefill_tokens=prefill_tokens,
                reused_tokens=reused,
            )
        )
        for seq, result in finished:  # after the step is logged, so a caller that awaited sees it
            seq.resolve(result)

    def _forward_and_sample(
        self,
        stepping: list[_Sequence],
        packed: list[int],
        positions: list[int],
        logit_rows: list[int],
        layout: _ragged.StepLayout,
    ) -> tuple[list[int], list[float]]:
        device = self.device
        rows = torch.tensor(logit_rows, device=device) if len(logit_rows) != len(packed) else None
        logits = self._forward(
            torch.tensor(packed, device=device), torch.tensor(positions, device=device), layout, rows
        )  # [n, vocab] float32
        params = [seq.request.sampling for seq in stepping]
        temperatures = [p.temperature for p in params]
        uniforms = [
            0.0 if p.temperature == 0 else float(torch.rand((), generator=seq.generator))
            for p, seq in zip(params, stepping)
        ]
        tokens, logprobs = sample_next_tokens(
            logits,
            torch.tensor(temperatures, device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=device),
            torch.tensor(uniforms, device=device),
        )
        return tokens.tolist(), logprobs.tolist()

    def _finish(
        self,
        seq: _Sequence,
        reason: FinishReason | None = None,
        *,
        matched: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        self._release(seq, keep=error is None)
        seq.resolve(error if error is not None else self._result(seq, reason, matched))

    def _release(self, seq: _Sequence, *, keep: bool = True) -> None:
        self._running.remove(seq)
        # Retain the slot's K/V for a later request sharing the prefix (not after a failed step).
        self._slots.release(seq.slot, seq.tokens[: seq.cached] if keep and seq.prefilled else [])

    def _result(self, seq: _Sequence, reason: FinishReason, matched: int | None = None) -> GenerateResult:
        return GenerateResult(
            output_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs),
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=len(seq.request.input_ids),
            weight_version=self.weight_version,
            cached_tokens=seq.reused,
        )

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            pending = self._inbox + list(self._waiting) + self._running
            self._inbox.clear()
            updates, self._updates = self._updates, []
        self._waiting.clear()
        self._running.clear()
        for seq in pending:
            seq.resolve(error)
        for update in updates:
            update.resolve(error)


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[object], None]:
    """A thread-safe, idempotent way to complete ``future`` from the worker thread."""

    def settle(outcome: object) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def resolve(outcome: object) -> None:
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is waiting any more

    return resolve


def _load_model(model: str | Path | torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, Path)):
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model directory {model} does not exist")
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    config = model.config
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("the built-in engine does not support sliding-window attention layers")
    _ragged.install()
    model.config._attn_implementation = _ragged.ATTENTION_NAME
    return model

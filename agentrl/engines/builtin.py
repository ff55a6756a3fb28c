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
   ``torch.Generator`` (``sampling.py``), stop on a stop token or on the token that completes a
   stop string (kept in the output, like SGLang; ``stops.py``), on ``max_new_tokens`` or when the
   context reaches ``max_seq_len``.

Steps 2 to 4 are the scheduler's (``_scheduler.py``); this module is the engine's face (the
``Engine`` protocol, the hand-over from callers) and its worker (where the steps run).

Prefix reuse (``_prefix_cache.py``): a finished request leaves its K/V in its slot, and a new
request that starts with the same tokens (the next turn of a conversation, another sample of the
same prompt) reuses them instead of computing them again. The reused count is reported as
``cached_tokens`` (as SGLang reports its radix-cache hits).

Why a hand-written scheduler: transformers 5.23's own continuous batching
(``model.generate_batch`` / ``init_continuous_batching``) was measured on this CPU with the 1M and
18M tiny models slower than even a static-batch ``model.generate`` of the same requests (figures
in docs/benchmarks.md); it also has no per-request seed (one global ``torch.multinomial``) and a
single greedy/sampling switch for the whole batch.

Weight updates drain: once an update is requested no request is admitted, the running ones
finish under the old weights, the new weights are copied in place, retained prefixes are
dropped (their K/V belong to the old weights), ``weight_version`` moves on and admission resumes.
So every result is produced by exactly one weight version, which it reports. With
``partial=True`` (partial rollouts, ``rollout.partial``) an update does not wait: the running
requests are interrupted, keeping their sampled tokens and logprobs, and resume under the new
weights (prompt and tokens so far prefilled again), each token's version in ``output_versions``.

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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from agentrl.engines import _ragged
from agentrl.engines._graphs import StaticDecode
from agentrl.engines._packed import PackedDecoderForward, make_forward
from agentrl.engines._scheduler import Scheduler, Sequence, StepRecord, WeightUpdate
from agentrl.engines.base import FinishReason, GenerateRequest, GenerateResult
from agentrl.engines.stops import StopStrings
from agentrl.errors import EngineError, EngineUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BuiltinEngine", "EngineStats", "StepRecord"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    interrupted_requests: int = 0  # running requests a weight update interrupted (partial rollouts)
    resumed_requests: int = 0  # ... and re-admitted under the new weights
    busy_s: float = 0.0  # seconds spent in steps (forward and sampling)


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
        tokenizer: Any = None,
        decode_graphs: bool | None = None,
        partial: bool = False,
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
        # decodes sampled tokens for stop strings (``SamplingParams.stop``); when not given, loaded
        # from the model's directory at the first request that has stop strings
        self._tokenizer = tokenizer
        self._tokenizer_source = str(model) if isinstance(model, (str, Path)) else getattr(config, "_name_or_path", None)
        self.vocab_size: int = config.vocab_size
        self.max_seq_len: int = max_seq_len or config.max_position_embeddings
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        forward = make_forward(self.model, self.max_seq_len)
        # decode-only steps on a static layout (_graphs.py), replayed as CUDA graphs on a GPU;
        # None: on CUDA (the CPU keeps the default path); True on the CPU runs the static layout
        # without graphs. Only the fast forward (Qwen2, Qwen3, Llama) has it.
        if decode_graphs is None:
            decode_graphs = self.device.type == "cuda"
        static = decode_graphs and isinstance(forward, PackedDecoderForward)
        cache = _ragged.SlotKVCache(
            num_layers=config.num_hidden_layers,
            slots=max_batch_size + 1 if static else max_batch_size,  # + the static path's scratch slot
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            max_len=self.max_seq_len,
            dtype=torch_dtype,
            device=self.device,
            query_heads=config.num_attention_heads,
        )
        # Owned by the worker (the thread or task that runs the steps).
        self._scheduler = Scheduler(
            self.model,
            forward,
            cache,
            device=self.device,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            step_log_size=step_log_size,
            static_decode=StaticDecode(forward, cache, max_batch_size=max_batch_size, device=self.device, graphs=True)
            if static else None,
        )
        self._seed_source = torch.Generator().manual_seed(seed)
        # Shared with the caller threads, guarded by _cv.
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._updates: list[WeightUpdate] = []
        self._closed = False
        self._flush_requested = False
        self._fatal: BaseException | None = None
        # The worker thread exits after ``idle_exit_s`` without work and the next call starts it
        # again. Measured (docs/benchmarks.md): a colocated trainer's update (hundreds of small
        # ops) ran slower while this thread idled, and as fast as with no engine once it had exited. The
        # likely cause: an idle thread that has run torch ops keeps an OpenMP thread team, and
        # libgomp cuts its spin-waiting short when it manages more threads than there are cores.
        self._idle_exit_s = idle_exit_s
        self.steps_on = steps_on
        # partial rollouts: a weight update interrupts the running requests instead of draining
        # them; they resume under the new weights keeping what they sampled (Scheduler.interrupt_running)
        self.partial = partial
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
        stop_strings = self._stop_strings(sampling.stop)
        with self._cv:
            if self._closed:
                raise EngineUnavailable("the built-in engine is closed")
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            sequence = Sequence(
                rid=rid,
                request=request,
                tokens=list(request.input_ids),
                stop_ids=frozenset(sampling.stop_token_ids),
                stop_strings=stop_strings,
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

    def _stop_strings(self, stop: tuple[str, ...]) -> StopStrings | None:
        if not stop:
            return None
        if self._tokenizer is None:
            if not self._tokenizer_source:
                raise EngineError("stop strings need a tokenizer: pass BuiltinEngine(..., tokenizer=...)")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_source)
        tokenizer = self._tokenizer
        return StopStrings(stop, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

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
            self._updates.append(WeightUpdate(state_dict, path, version, strict, _resolver(loop, future)))
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

    @property
    def weight_version(self) -> int:
        """The version of the weights the next request runs under."""
        return self._scheduler.weight_version

    @property
    def step_log(self) -> deque[StepRecord]:
        """The last ``step_log_size`` steps, oldest first."""
        return self._scheduler.step_log

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        counters = scheduler.counters
        return EngineStats(
            steps=counters["steps"],
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(self._inbox),
            generated_tokens=counters["generated"],
            prefill_tokens=counters["prefill"],
            reused_tokens=counters["reused"],
            weight_version=scheduler.weight_version,
            kv_cache_bytes=scheduler.cache.nbytes(),
            interrupted_requests=counters["interrupted"],
            resumed_requests=counters["resumed"],
            busy_s=scheduler.busy_s,
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
        if request.policy:  # one model, one policy: several are served by PolicyEngines (engines/policies.py)
            raise ValueError(f"request names policy {request.policy!r}; this engine serves the main policy only")
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

    def _take_work(self) -> tuple[set[str], bool, bool, list[WeightUpdate]]:
        """Move what callers handed over to the worker's side (the caller holds ``_cv``)."""
        for seq in self._inbox:
            self._scheduler.enqueue(seq)
        self._inbox.clear()
        aborts, self._abort_rids = self._abort_rids, set()
        abort_all, self._abort_all = self._abort_all, False
        flush, self._flush_requested = self._flush_requested, False
        if self._updates and self.partial and self._scheduler.running:
            self._scheduler.interrupt_running()
        updates = list(self._updates) if not self._scheduler.running else []
        if updates:
            self._updates.clear()
        return aborts, abort_all, flush, updates

    def _work(self, aborts: set[str], abort_all: bool, flush: bool, updates: list[WeightUpdate]) -> None:
        """Apply aborts, a cache flush and weight updates, then run one step if anything runs."""
        scheduler = self._scheduler
        if aborts or abort_all:
            scheduler.apply_aborts(aborts, abort_all)
        if flush:
            scheduler.slots.drop_retained()
        for update in updates:
            scheduler.apply_update(update)
        if self._updates_pending():
            admitted, copies = [], []  # drain: running requests finish under the current weights
        else:
            admitted, copies = scheduler.admit()
        if scheduler.running:
            scheduler.step(admitted, copies)

    def _shut_down(self) -> None:
        with self._cv:
            self._closed = True  # later calls fail at once instead of waiting on a dead worker
        self._fail_all(EngineUnavailable(f"the built-in engine stopped: {self._fatal!r}" if self._fatal else "the built-in engine is closed"))

    def _has_work(self) -> bool:
        admissible = bool(self._scheduler.waiting) and not self._updates  # an update holds back admission
        return bool(
            self._inbox or self._scheduler.running or admissible or self._updates
            or self._abort_rids or self._abort_all or self._flush_requested
        )  # fmt: skip

    def _updates_pending(self) -> bool:
        with self._cv:
            return bool(self._updates)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            pending = self._inbox + list(self._scheduler.waiting) + self._scheduler.running
            self._inbox.clear()
            updates, self._updates = self._updates, []
        self._scheduler.waiting.clear()
        self._scheduler.running.clear()
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

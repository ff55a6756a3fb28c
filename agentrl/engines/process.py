"""The built-in engine in a process of its own: ``EngineProcess``, an ``Engine`` that forwards.

Asynchronous training (``rollout.max_staleness > 0``) places the built-in engine here rather than
on a thread of the trainer's process, so engine steps and the trainer's update no longer share one
interpreter (the GIL, torch's intra-op thread pool), and the event loop that runs the tools and
agent programs is never held by an engine step: it only sends requests and receives results.

    trainer process                                   engine process (_process_child.py)
      agent loops, tools  ── EngineProcess ── socket ──  reader thread ─► event loop:
      (event loop)            generate/abort/stats          BuiltinEngine(steps_on="event_loop")
      trainer (main thread) ─ update_weights ─ shared file mapping (or a checkpoint directory)

The child is ``python -m agentrl.engines._process_child`` started with ``subprocess`` (not
``multiprocessing``: nothing of the parent's ``__main__`` is imported again), its torch thread
count and ``OMP_WAIT_POLICY=PASSIVE`` set in its environment before torch loads, so two processes
sharing the cores do not spin against each other. It loads its own copy of the weights.
``agentrl train`` forks it instead, before its start-up, where it can (``preforked.py``): the
child then has torch and transformers' model code loaded already.

Weight updates: ``update_weights(state_dict)`` copies the tensors into a file mapping shared with
the child (created once per layout, unlinked as soon as both sides have mapped it: nothing is
left behind if either dies) and the child copies them into its model; ``update_weights(path=...)``
hands the child a checkpoint directory (``engine.weight_sync=disk``). Which is faster, measured:
docs/benchmarks.md "The engine in its own process".

Every wait is bounded: start-up by ``start_timeout_s`` (default ``sync_timeout_s``), a weight
update and a cache flush by ``sync_timeout_s``, a stats call and closing by less; a child
that dies fails every call waiting on it, and every later one, with ``EngineUnavailable`` naming
the process, its pid and how it ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from agentrl.engines import preforked
from agentrl.engines.base import GenerateRequest, GenerateResult
from agentrl.errors import EngineError, EngineTimeout, EngineUnavailable

if TYPE_CHECKING:
    import torch

    from agentrl.engines.builtin import EngineStats

__all__ = ["EngineProcess", "default_engine_threads"]

# the child's reader thread answers a stats call at once, even mid-step: a child that does not
# within this bound is stopped or stuck (and a caller that asks while reporting a stuck weight
# sync must not wait another engine.sync_timeout_s)
STATS_TIMEOUT_S = 10.0


def default_engine_threads() -> int:
    """The engine process's torch threads when ``engine.threads`` is null: ``OMP_NUM_THREADS``
    where the environment bounds the job, else half the machine's cores (the trainer keeps the rest)."""
    bound = os.environ.get("OMP_NUM_THREADS", "")
    if bound.isdigit() and int(bound) >= 1:
        return int(bound)
    return max(1, (os.cpu_count() or 2) // 2)


class EngineProcess:
    """A ``BuiltinEngine`` in a child process (see the module docstring); keyword arguments are
    the engine's (``device``, ``dtype``, ``max_batch_size``, ``seed``, ``partial``, ...)."""

    def __init__(self, model: str | Path, *, threads: int, sync_timeout_s: float = 600.0, start_timeout_s: float | None = None,
                 name: str = "the built-in engine process", omp_wait_policy: str = "PASSIVE", wait_ready: bool = True,
                 **engine_kwargs: Any):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model directory {model} does not exist")
        if "dtype" in engine_kwargs and not isinstance(engine_kwargs["dtype"], str):
            engine_kwargs["dtype"] = str(engine_kwargs["dtype"]).removeprefix("torch.")
        self.sync_timeout_s = sync_timeout_s
        self.partial = bool(engine_kwargs.get("partial", False))
        self._lock = threading.Lock()  # guards _calls, _next_call, _dead and sending
        self._calls: dict[int, Callable[[object], None]] = {}
        self._next_call = 0
        self._dead: str | None = None  # why calls fail: the child ended, or close()
        self._map: tuple[Any, list[tuple[str, str, tuple[int, ...], int, int]], str] | None = None
        self._map_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        # a child forked before agentrl train's start-up (preforked.py) has torch and transformers
        # loaded already; else a new interpreter
        forked = preforked.take(threads=threads, wait_policy=omp_wait_policy)
        if forked is not None:
            self._process: subprocess.Popen | preforked.ForkedChild = forked
            ours = forked.sock
        else:
            ours, theirs = socket.socketpair()
            # PASSIVE: an OpenMP thread that waits sleeps at once instead of spinning on a core another
            # process needs (the trainer, a job beside this one); "" leaves libgomp's default (measured
            # against each other: docs/benchmarks.md)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
            env.pop("OMP_WAIT_POLICY", None)
            if omp_wait_policy:
                env["OMP_WAIT_POLICY"] = omp_wait_policy
            self._process = subprocess.Popen([sys.executable, "-m", "agentrl.engines._process_child", str(theirs.fileno())],
                                             pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
        self.pid = self._process.pid
        self.name = f"{name} (pid {self.pid})"
        self._conn = Connection(ours.detach())
        self._conn.send(("start", {"model": str(model), "threads": threads, "engine": engine_kwargs}))
        self._ready = threading.Event()
        self._info: dict[str, Any] = {}
        self._model = str(model)
        self._start_timeout_s = start_timeout_s or sync_timeout_s

        def on_ready(info: object) -> None:
            if isinstance(info, BaseException):
                self._info["error"] = info
            else:
                self._info.update(info)  # type: ignore[call-overload]
            self._ready.set()

        self._calls[-1] = on_ready
        self._version: int | None = None
        self._reader = threading.Thread(target=self._read, name="agentrl-engine-results", daemon=True)
        self._reader.start()
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the child has loaded the model (at most ``start_timeout_s``); raise its
        start-up failure. ``wait_ready=False`` at construction leaves this to the first call, so
        the child loads while the caller goes on (the trainer's start-up)."""
        if not self._ready.wait(self._start_timeout_s):
            self.close()
            raise EngineTimeout(f"{self.name} did not load {self._model} within {self._start_timeout_s} s")
        if "error" in self._info:
            self.close()
            raise self._info["error"]

    async def _ready_async(self) -> None:
        if not self._ready.is_set():
            await asyncio.to_thread(self.wait_ready)  # the caller's event loop keeps running meanwhile
        elif "error" in self._info:
            self.wait_ready()

    @property
    def vocab_size(self) -> int:
        self.wait_ready()
        return int(self._info["vocab_size"])

    @property
    def max_seq_len(self) -> int:
        self.wait_ready()
        return int(self._info["max_seq_len"])

    @property
    def threads(self) -> int:
        """The child's torch threads, as it reports them."""
        self.wait_ready()
        return int(self._info["threads"])

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.rid is None:  # aborting a cancelled call needs the id the child knows
            request = dataclasses.replace(request, rid=uuid.uuid4().hex)
        await self._ready_async()
        future = self._call_async(lambda call: ("generate", call, request))
        try:
            result: GenerateResult = await future
        except asyncio.CancelledError:
            await self.abort(request.rid)  # type: ignore[arg-type]
            raise
        return result

    async def abort(self, rid: str) -> None:
        """Abort a waiting or running request; it returns with finish reason ABORT."""
        self._send_quietly(("abort", rid))

    async def abort_all(self) -> None:
        self._send_quietly(("abort_all",))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None,
                             version: int | None = None, strict: bool = True) -> None:
        """New weights for the child: a state dict through the shared mapping, or a checkpoint
        directory it reads; drains (or, with ``partial``, interrupts) its running requests first."""
        if (state_dict is None) == (path is None):
            raise ValueError("update_weights needs exactly one of state_dict or path")
        await self._ready_async()
        source = ("path", str(path)) if path is not None else self._write_map(state_dict)  # type: ignore[arg-type]
        what = f"a weight update to version {version}" if version is not None else "a weight update"
        self._version = await self._bounded(self._call_async(lambda call: ("update", call, version, source, strict)), what)
        if self._map is not None and source[0] == "map" and not self._map[2].startswith("unlinked:"):
            os.unlink(self._map[2])  # both sides hold the mapping now: the name is not needed
            self._map = (self._map[0], self._map[1], "unlinked:" + self._map[2])

    async def health(self) -> bool:
        return self._dead is None and self._process.poll() is None

    # ------------------------------------------------------------------ extras

    async def flush_cache(self) -> None:
        await self._ready_async()
        await self._bounded(self._call_async(lambda call: ("flush", call)), "a cache flush")

    @property
    def weight_version(self) -> int:
        """The version of the last weights the child confirmed."""
        if self._version is None:
            self.wait_ready()
            self._version = int(self._info["weight_version"])
        return self._version

    def stats(self) -> EngineStats:
        """The child engine's counters (a round trip, bounded by ``sync_timeout_s``); all zero at
        version 0 while the child still loads (nothing has run in it), so a caller that takes a
        baseline at start-up (the actor's ``engine_stats``) does not wait for the load."""
        if not self._ready.is_set() and not self._dead:
            from agentrl.engines.builtin import EngineStats

            return EngineStats(steps=0, running=0, waiting=0, generated_tokens=0, prefill_tokens=0, reused_tokens=0,
                               weight_version=0, kv_cache_bytes=0)
        self.wait_ready()
        done = threading.Event()
        box: list[object] = []

        def settle(outcome: object) -> None:
            box.append(outcome)
            done.set()

        self._register(settle, lambda call: ("stats", call))
        limit = min(self.sync_timeout_s, STATS_TIMEOUT_S)
        if not done.wait(limit):
            raise EngineTimeout(f"{self.name} did not answer a stats call within {limit} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the child (it fails what it still runs); waits at most ``sync_timeout_s``, then kills it."""
        self._fail_all(f"{self.name} is closed")
        self._send_quietly(("close",))
        try:
            self._process.wait(min(self.sync_timeout_s, 30.0))
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()
        if self._map is not None and not self._map[2].startswith("unlinked:"):
            Path(self._map[2]).unlink(missing_ok=True)
        self._map = None

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "EngineProcess":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def _register(self, settle: Callable[[object], None], message: Callable[[int], tuple[Any, ...]]) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineUnavailable(self._dead)
            call = self._next_call
            self._next_call += 1
            self._calls[call] = settle
            try:
                self._conn.send(message(call))
            except OSError as exc:
                del self._calls[call]
                raise EngineUnavailable(f"{self.name}: cannot send to it ({exc})") from exc

    def _call_async(self, message: Callable[[int], tuple[Any, ...]]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(outcome: object) -> None:
            def on_loop() -> None:
                if future.done():
                    return
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

            try:
                loop.call_soon_threadsafe(on_loop)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody waits any more

        self._register(settle, message)
        return future

    async def _bounded(self, future: asyncio.Future[Any], what: str) -> Any:
        try:
            return await asyncio.wait_for(future, self.sync_timeout_s)
        except asyncio.TimeoutError:
            raise EngineTimeout(f"{self.name} did not finish {what} within engine.sync_timeout_s={self.sync_timeout_s} s") from None

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:
                pass  # the child is gone (or closed): the reader fails what waits on it

    def _read(self) -> None:
        """The reader thread: settles each call with the child's answer; when the socket closes,
        fails every call (and every later one) naming how the child ended."""
        fatal = ""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "ready":
                self._settle(-1, message[1])
            elif kind == "ok":
                self._settle(message[1], message[2])
            elif kind == "error":
                self._settle(message[1], _remote_error(message[2], message[3], self.name))
            elif kind == "fatal":
                fatal = f": {message[1]}"
        try:
            code = self._process.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("is still running" if code is None else f"was killed by signal {-code}" if code < 0
               else f"exited with code {code}")
        self._fail_all(f"{self.name} {how}{fatal}")

    def _settle(self, call: int, outcome: object) -> None:
        with self._lock:
            settle = self._calls.pop(call, None)
        if settle is not None:
            settle(outcome)

    def _fail_all(self, why: str) -> None:
        """Every call waiting now fails, and every later one, with ``EngineUnavailable(why)``
        (the first reason stays: a child that died before ``close`` is reported as such)."""
        with self._lock:
            self._dead = self._dead or why
            calls, self._calls = self._calls, {}
            failure = EngineUnavailable(self._dead)
        for settle in calls.values():
            settle(failure)

    def _reserve(self, size: int) -> str:
        """The shared weights file: in /dev/shm (memory), else, where that has no room for it (a
        container's small /dev/shm), in the temp dir (the page cache still shares it)."""
        prefix = f"agentrl-engine-{self.pid}-"
        if self._map_dir is not None:
            try:
                return _reserve_file(self._map_dir, prefix, size)
            except OSError:
                self._map_dir = None
        try:
            return _reserve_file(None, prefix, size)
        except OSError as exc:
            raise EngineError(f"{self.name}: no room for the {size}-byte shared weights file in /dev/shm or "
                              f"{tempfile.gettempdir()}: {exc}") from exc

    def _write_map(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[str, str, list[tuple[str, str, tuple[int, ...], int, int]]]:
        """Copy a state dict into the file mapping shared with the child (made for its layout)."""
        import torch

        layout, offset = [], 0
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
            offset += (nbytes + 63) // 64 * 64
        if self._map is None or self._map[1] != layout:
            if self._map is not None and not self._map[2].startswith("unlinked:"):
                Path(self._map[2]).unlink(missing_ok=True)
            path = self._reserve(max(offset, 1))
            self._map = (torch.from_file(path, shared=True, size=max(offset, 1), dtype=torch.uint8), layout, path)
        buffer, _, path = self._map
        from agentrl.engines._process_child import views

        with torch.no_grad():
            for (name, target), tensor in zip(views(buffer, layout).items(), state_dict.values()):
                target.copy_(tensor.detach().reshape(target.shape))
        return ("map", path.removeprefix("unlinked:"), layout)


def _reserve_file(directory: str | None, prefix: str, size: int) -> str:
    """A file of ``size`` bytes whose blocks are allocated now: a mapping of a sparse file on a full
    tmpfs would end the process with SIGBUS at the first write past the space left."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".weights", dir=directory)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def _remote_error(type_name: str, message: str, who: str) -> BaseException:
    """The child's exception as the parent raises it: the same class where the caller could catch
    it by type (a bad request or update), else an ``EngineError`` naming the process."""
    known: dict[str, type[BaseException]] = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
                                             "EngineUnavailable": EngineUnavailable, "EngineTimeout": EngineTimeout,
                                             "EngineError": EngineError, "RuntimeError": RuntimeError}
    cls = known.get(type_name)
    return cls(message) if cls is not None else EngineError(f"{who}: {type_name}: {message}")


"""The child side of ``EngineProcess`` (``process.py``): a ``BuiltinEngine`` served over a socket.

Started as ``python -m agentrl.engines._process_child FD`` with the thread counts and the OpenMP
wait policy already in its environment (set by the parent before torch loads here), or forked
from ``agentrl train``'s process before its start-up (``preforked.py``), torch already loaded. One asyncio
event loop on the main thread runs the engine's steps (``steps_on="event_loop"``: one OpenMP
team) and the requests; a reader thread moves the parent's messages onto that loop, and answers
stats calls itself (counters read between two of the GIL's switches, even while a step runs). The
socket closing (the parent ended, or was killed) ends this process.

Messages, parent to child: ``("start", spec)`` first, then ``("generate", call, request)``,
``("abort", rid)``, ``("abort_all",)``, ``("update", call, version, source, strict)`` with
``source`` ``("map", path, layout)`` (a shared file mapping written by the parent) or
``("path", directory)`` (a transformers checkpoint), ``("stats", call)``, ``("flush", call)``,
``("close",)``. Child to parent: ``("ready", info)``, ``("ok", call, value)``,
``("error", call, type name, message)``, ``("fatal", message)``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main"]


def main(fd: int) -> None:
    # a Ctrl-C at the terminal signals the whole process group: the parent decides what ends,
    # and its end closes the socket, which ends this process (no traceback of the child's)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    kind, spec = conn.recv()
    assert kind == "start", kind
    # a started child has these from its parent's environment already; a forked one
    # (preforked.py) has its parent's, read by whatever loads after this
    threads = str(spec["threads"])
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    import torch

    torch.set_num_threads(spec["threads"])
    try:
        asyncio.run(_serve(conn, spec))
    except BaseException as exc:  # the parent hears why, then sees the socket close
        try:
            conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        conn.close()


async def _serve(conn: Connection, spec: dict[str, Any]) -> None:
    from agentrl.engines.builtin import BuiltinEngine

    engine = BuiltinEngine(spec["model"], steps_on="event_loop", **spec["engine"])
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()

    sending = threading.Lock()  # replies go out from the loop and (stats) from the reader thread

    def read() -> None:  # the reader thread: blocks in recv; answers stats itself, even mid-step
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None  # the parent is gone
            if message is not None and message[0] == "stats":
                reply(("ok", message[1], engine.stats()))  # counters only: read, never changed here
                continue
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message is None or message[0] == "close":
                return

    maps: dict[str, Any] = {}  # path of a shared weights file -> its byte tensor
    tasks: set[asyncio.Task] = set()

    def reply(message: tuple[Any, ...]) -> None:
        try:
            with sending:
                conn.send(message)
        except OSError:
            pass  # the parent is gone; the reader thread ends the loop

    async def answer(call: int, work: Any) -> None:
        try:
            reply(("ok", call, await work))
        except Exception as exc:  # the caller's error (a bad request, a bad update): the engine lives on
            reply(("error", call, type(exc).__name__, str(exc)))

    def start(call: int, work: Any) -> None:
        task = loop.create_task(answer(call, work))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    threading.Thread(target=read, name="agentrl-engine-inbox", daemon=True).start()
    reply(("ready", {"pid": os.getpid(), "vocab_size": engine.vocab_size, "max_seq_len": engine.max_seq_len,
                     "weight_version": engine.weight_version, "threads": torch_threads()}))
    try:
        while True:
            message = await inbox.get()
            if message is None or message[0] == "close":
                break
            kind = message[0]
            if kind == "generate":
                start(message[1], engine.generate(message[2]))
            elif kind == "abort":
                await engine.abort(message[1])
            elif kind == "abort_all":
                await engine.abort_all()
            elif kind == "update":
                _, call, version, source, strict = message
                start(call, _update(engine, maps, version, source, strict))
            elif kind == "flush":
                start(message[1], engine.flush_cache())
            else:
                reply(("fatal", f"unknown message {kind!r}"))
    finally:
        engine.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _update(engine: Any, maps: dict[str, Any], version: int | None, source: tuple[Any, ...], strict: bool) -> int:
    if source[0] == "path":
        await engine.update_weights(path=source[1], version=version, strict=strict)
    else:
        _, path, layout = source
        if path not in maps:  # mapped once; the parent unlinks the file once both sides hold it
            import torch

            size = max(offset + nbytes for _, _, _, offset, nbytes in layout)
            maps.clear()
            maps[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        await engine.update_weights(views(maps[path], layout), version=version, strict=strict)
    return engine.weight_version


def views(buffer: Any, layout: list[tuple[str, str, tuple[int, ...], int, int]]) -> dict[str, Any]:
    """The tensors a byte buffer holds at the layout's offsets (no copy)."""
    import torch

    return {name: buffer[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, offset, nbytes in layout}


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""An engine process forked before the trainer's start-up: the imports shared, not paid twice.

``EngineProcess`` otherwise starts ``python -m agentrl.engines._process_child``: a second
interpreter that imports torch and transformers' model code again before it can load the model,
seconds of CPU that asynchronous training waits for in its first step (docs/benchmarks.md,
"Compute-heavy workload"). ``agentrl train`` instead forks the engine's process from its own as
soon as it has read the config and imported those libraries, and before it has computed anything:
the child holds them already (copy-on-write) and waits on its socket, costing nothing, until the
trainer's ``EngineProcess`` hands it its model (the same ``("start", spec)`` message a started
child reads first); from there it is ``_process_child.main``, as a started child is.

Why only there: a process that has run a torch operation on more than one thread holds an OpenMP
thread team, and a forked child's first parallel region then waits forever for threads that were
not forked (GNU libgomp keeps no fork handler). ``allow`` marks the process as a fresh
command (the console entry point calls it), so a library caller or a test process that has
computed things never forks; ``prefork`` is called by ``agentrl train`` after reading its config,
before the trainer has built anything. libgomp also reads its wait policy (``OMP_WAIT_POLICY``)
once, when torch loads, so ``take`` hands the forked child only to an engine whose threads are one
(no team waits) or whose wait policy is the one this process loaded torch with; any other engine
is started as a new interpreter, as before.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["ForkedChild", "allow", "prefork", "take", "discard"]

_allowed = False
_waiting: "ForkedChild | None" = None


@dataclass
class ForkedChild:
    """A forked engine process as ``EngineProcess`` drives it: the ``subprocess.Popen`` calls it
    uses (``pid``, ``poll``, ``wait``, ``kill``) over ``os.waitpid``, and the parent's end of the
    socket. ``wait_policy``: the ``OMP_WAIT_POLICY`` torch was loaded with ("" for libgomp's default)."""

    pid: int
    sock: socket.socket
    wait_policy: str

    def __post_init__(self) -> None:
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one waitpid at a time (the result reader and close both wait)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its code is lost, it has ended
                    pid, status = self.pid, 0
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def allow() -> None:
    """Mark this process as a fresh command that may fork its engine early (the console entry)."""
    global _allowed
    _allowed = True


def prefork() -> bool:
    """Import torch and what loading a transformers model imports, then fork the engine's process
    to wait for its model. Only in a process ``allow`` marked, once, on the CPU (a CUDA context is
    never forked). Returns whether a child now waits."""
    global _waiting
    if not _allowed or _waiting is not None or not hasattr(os, "fork"):
        return False
    import torch

    if torch.cuda.is_available():
        return False
    # what AutoModelForCausalLM's class resolution imports for any decoder (the model's own
    # modelling module is small and loads in the child); the trainer imports them all anyway
    import transformers.generation.utils  # noqa: F401
    import transformers.masking_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import agentrl.engines.builtin  # noqa: F401  (the child's engine; the trainer's actor imports it too)

    ours, theirs = socket.socketpair()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        stream.flush()
    # a Ctrl-C in the instant after the fork waits (blocked) until the child ignores it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        ours.close()
        _serve(theirs, mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    theirs.close()
    _waiting = ForkedChild(pid, ours, os.environ.get("OMP_WAIT_POLICY", ""))
    return True


def take(*, threads: int, wait_policy: str) -> ForkedChild | None:
    """The waiting child for an engine of ``threads`` torch threads and OpenMP ``wait_policy``
    ("" for libgomp's default), once; None when none waits or it was forked with another policy
    that a team of threads would use."""
    global _waiting
    child = _waiting
    if child is None or (threads > 1 and child.wait_policy != wait_policy):
        return None
    _waiting = None
    return child


def discard() -> None:
    """End a child nobody took (its socket closes: it exits) and reap it."""
    global _waiting
    child, _waiting = _waiting, None
    if child is not None:
        child.sock.close()
        try:
            child.wait(10.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve(sock: socket.socket, mask: set[signal.Signals]) -> None:
    code = 1
    try:
        # the parent's handlers are the trainer's; this process ends when its socket closes, and
        # a Ctrl-C at the terminal is the parent's to handle (as _process_child.main has it)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # what the parent allocated stays out of the collector's passes (and its pages unshared);
        # the parent's start-up paused the collector, a long-lived server runs it
        gc.freeze()
        gc.enable()
        from agentrl.engines._process_child import main

        main(sock.detach())
        code = 0
    except EOFError:  # the parent ended (or discarded it) before handing it a model
        code = 0
    except BaseException:  # noqa: BLE001 - as a started child's: on stderr, and the parent sees the socket close
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)  # never the parent's atexit handlers or buffered streams

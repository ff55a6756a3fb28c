"""``python -m agentrl.engines.lifeline <parent pid> -- <command...>``: run a server that dies with its owner.

A managed server must not outlive the job that started it, however the job ends: a normal exit
and Ctrl-C stop it through ``ServerProcess.stop``, but a SIGKILLed driver runs no cleanup. The
lifeline is the leader of the server's process group (``launch_servers`` starts every server in a
session of its own). It starts the command as its child in that group and watches its owner:

* the kernel sends the lifeline SIGTERM when the owner dies (``PR_SET_PDEATHSIG``), and the lifeline
  also polls ``getppid()`` (the death signal follows the *thread* that forked, and is lost if
  the owner died before it was set);
* on the owner's death, or a SIGTERM/SIGINT, it SIGTERMs the whole group (an SGLang server is
  three processes: HTTP front, scheduler, detokenizer), waits ``GRACE_S``, then SIGKILLs it;
* when the command exits on its own, the lifeline ends the rest of the group and exits with the
  command's status, so the owner sees the server die (and can restart it);
* when the lifeline itself is SIGKILLed (it cannot clean up then), the kernel SIGKILLs the server
  (its ``PR_SET_PDEATHSIG``, set before exec); SGLang's own subprocesses die with the server;
* on its way out it removes the server's own temporary directory when ``launch_servers`` made one
  (``AGENTRL_SERVER_TMPDIR``): a server whose owner died (a Ray host actor killed) is never
  stopped through ``ServerProcess.stop``, which removes it otherwise.

Standard library only: it must start in well under a second.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1
TMPDIR_ENV = "AGENTRL_SERVER_TMPDIR"


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the getppid() poll still works
        pass


def _server_dies_with_lifeline() -> None:
    """In the server, before exec: if the lifeline is SIGKILLed it cannot stop the group (Ray, for
    one, SIGKILLs the children of an actor it kills), so the server gets SIGKILL from the kernel;
    SGLang's scheduler and detokenizer already die with the server."""
    _die_with_parent(signal.SIGKILL)


def _signal_group(sig: int) -> None:
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def _remove_server_tmpdir() -> None:
    directory = os.environ.get(TMPDIR_ENV)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _stop(child: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches the lifeline too
    _signal_group(signal.SIGTERM)
    try:
        child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _remove_server_tmpdir()
    _signal_group(signal.SIGKILL)  # whatever is left, the lifeline included


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m agentrl.engines.lifeline <parent pid> -- <command...>", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _die_with_parent()
    if os.getppid() != parent:  # the owner died before the death signal was armed
        return 1
    child = subprocess.Popen(command, preexec_fn=_server_dies_with_lifeline)
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if stopping or os.getppid() != parent:
                _stop(child)
                return 1
            continue
        # the server ended by itself: take its helpers with it, report its status
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _signal_group(signal.SIGTERM)
        time.sleep(0.5)
        _remove_server_tmpdir()
        return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

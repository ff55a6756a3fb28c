"""SGLang servers for one job: started from the config, watched, restarted, and stopped with it.

``engine=sglang`` runs in one of two modes (``engine.servers``):

* *managed* (``servers: []``): the driver (``agentrl train``'s or ``agentrl rollout``'s process)
  starts ``engine.num_servers`` servers with ``ManagedServers``: one process group each,
  ``launch.py``'s launcher, the typed flags of ``EngineConfig`` (tp size, memory fraction, context
  length, attention backend, KV tokens) plus ``engine.launch_args`` as given; on a CPU the recipe
  of ``sglang_cpu/``. A watchdog thread restarts a server that dies (the ``SGLangEngine`` client
  takes it out of rotation meanwhile and brings it back, at the current weights, once it answers).
  Every server runs under ``agentrl.engines.lifeline``, so none outlives the driver, even a
  SIGKILLed one; a normal exit and Ctrl-C stop them through ``ManagedServers.stop``.
* *external* (``servers: [url, ...]``): servers the user started. Rollouts work against any of
  them; training needs the disk weight sync to reach them, so only servers on this machine
  (which read the run directory the trainer writes) are accepted for ``agentrl train``.

The servers are subprocess groups owned by the driver, not Ray actors: one machine's servers
need no placement, and a subprocess group is what the death-signal lifeline can clean up. On a
multi-node Ray cluster the servers run on the driver's node (see the README's diagram).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

from agentrl.config.schema import EngineConfig, TrainConfig
from agentrl.engines.launch import LaunchedServers, ServerProcess, ServerSpec, launch_servers, serve_specs, sglang_specs
from agentrl.errors import ConfigError, EngineUnavailable

__all__ = ["ManagedServers", "managed_specs", "with_lifeline", "check_engine_config", "engine_device", "LOCAL_HOSTS"]

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
MAX_RESTARTS = 3  # per server and job: a server that keeps dying is a problem to report, not hide


def engine_device(engine: EngineConfig) -> str:
    if engine.device != "auto":
        return engine.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _typed_flags(engine: EngineConfig) -> list[str]:
    flags: list[str] = []
    for flag, value in (
        ("--mem-fraction-static", engine.mem_fraction_static),
        ("--context-length", engine.context_length),
        ("--attention-backend", engine.attention_backend),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def managed_specs(engine: EngineConfig, model_path: str | Path, *, threads: int = 1) -> list[ServerSpec]:
    """The ``engine.num_servers`` servers of the config, without their lifeline (see ``with_lifeline``)."""
    extra = [*_typed_flags(engine), *engine.launch_args]
    if engine.launcher == "agentrl":
        return serve_specs(model_path, num_servers=engine.num_servers, threads=threads)
    if engine_device(engine) == "cpu":
        from agentrl.engines.sglang_cpu.env import unavailable_reason, venv_dir
        from agentrl.engines.sglang_cpu.server import sglang_cpu_specs

        if engine.tp_size != 1:
            raise ConfigError([("engine.tp_size", f"{engine.tp_size}: tensor parallelism needs GPUs; on a CPU it is 1")])
        if engine.python is None and (reason := unavailable_reason(venv_dir())) is not None:
            raise EngineUnavailable(f"engine=sglang on a CPU needs the cached SGLang venv: {reason}")
        specs = sglang_cpu_specs(model_path, num_servers=engine.num_servers, threads=threads,
                                 max_total_tokens=engine.max_total_tokens or 65536, extra_args=extra)
        if engine.python is not None:
            specs = [replace(s, command=[engine.python, *s.command[1:]]) for s in specs]
        return specs
    if engine.max_total_tokens is not None:
        extra += ["--max-total-tokens", str(engine.max_total_tokens)]
    return sglang_specs(model_path, num_servers=engine.num_servers, tp_size=engine.tp_size,
                        python=engine.python or sys.executable, extra_args=extra)


def with_lifeline(spec: ServerSpec, owner_pid: int | None = None) -> ServerSpec:
    """The same server run under ``agentrl.engines.lifeline``: it ends when ``owner_pid`` (this
    process by default) ends, however it ends."""
    owner = os.getpid() if owner_pid is None else owner_pid
    return replace(spec, command=[sys.executable, "-m", "agentrl.engines.lifeline", str(owner), "--", *spec.command])


class ManagedServers:
    """The job's servers: started by ``start`` (all ready, or none left running), restarted by a
    watchdog thread when one dies, stopped by ``stop`` (idempotent; also a context manager)."""

    def __init__(self, specs: Sequence[ServerSpec], *, ready_timeout_s: float, log_dir: str | Path,
                 check_interval_s: float = 1.0, max_restarts: int = MAX_RESTARTS):
        self.specs = [with_lifeline(s) for s in specs]
        self.ready_timeout_s, self.log_dir = ready_timeout_s, Path(log_dir)
        self.check_interval_s, self.max_restarts = check_interval_s, max_restarts
        self.servers: list[ServerProcess] = []
        self.restarts = [0] * len(self.specs)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, model_path: str | Path, *, log_dir: str | Path, threads: int = 1) -> "ManagedServers":
        return cls(managed_specs(cfg.engine, model_path, threads=threads), ready_timeout_s=cfg.engine.ready_timeout_s, log_dir=log_dir)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    @property
    def api_key(self) -> str | None:
        """The key the servers of this launch share (restarts keep it): what clients pass."""
        keys = {s.api_key for s in self.specs}
        return keys.pop() if len(keys) == 1 else None

    def start(self) -> "ManagedServers":
        self.servers = launch_servers(self.specs, ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir).servers
        self._watchdog = threading.Thread(target=self._watch, name="agentrl-server-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=self.ready_timeout_s + 30)
        with self._lock:
            LaunchedServers(self.servers).stop()

    def __enter__(self) -> "ManagedServers":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_interval_s):
            for index, server in enumerate(list(self.servers)):
                if server.alive() or self._stopping.is_set() or self.restarts[index] >= self.max_restarts:
                    continue
                self._restart(index, server)

    def _restart(self, index: int, dead: ServerProcess) -> None:
        self.restarts[index] += 1
        log.warning("server %s exited with %s; restarting it (%d/%d). Its log ends:\n%s", dead.url,
                    dead.process.returncode, self.restarts[index], self.max_restarts, dead.log_tail(10))
        dead.stop(grace_s=1.0)  # reap the group's leftovers
        if dead.log_path.exists():  # keep the dead server's log next to the new one's
            dead.log_path.rename(dead.log_path.with_suffix(f".log.{self.restarts[index]}"))
        started = time.monotonic()
        try:
            new = launch_servers([self.specs[index]], ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir).servers[0]
        except EngineUnavailable as exc:
            log.error("restarting %s failed: %s", dead.url, exc)
            return
        with self._lock:
            if self._stopping.is_set():
                new.stop(grace_s=2.0)
                return
            self.servers[index] = new
        log.warning("server %s is back after %.1f s", new.url, time.monotonic() - started)


def check_engine_config(cfg: TrainConfig, *, training: bool) -> None:
    """Refuse, before any compute, an engine setting the command cannot honour."""
    engine = cfg.engine
    if engine.weight_sync == "nccl":
        raise ConfigError([("engine.weight_sync", "nccl needs GPUs for the trainer and the servers and is not wired into "
                            "agentrl train yet; use disk (sglang) or memory/disk (builtin)")])
    if engine.backend == "builtin":
        return
    if engine.backend == "scripted":
        if training:
            raise ConfigError([("engine.backend", "scripted answers from a script and has no weights to train; "
                                "smoke-test a loop with agentrl rollout engine=scripted engine.script=FILE")])
        if engine.script is None:
            raise ConfigError([("engine.script", "engine=scripted needs a script file: engine.script=FILE "
                                "(one {\"row\": ROW_ID, \"answers\": [...]} per line)")])
        return
    if engine.weight_sync == "memory":
        raise ConfigError([("engine.weight_sync", "memory: SGLang servers are other processes; use disk (or auto)")])
    if engine.servers and training:
        remote = [url for url in engine.servers if urlparse(url).hostname not in LOCAL_HOSTS]
        if remote:
            raise ConfigError([("engine.servers", f"{remote}: agentrl train syncs weights by disk (the servers load "
                                "<run dir>/engine_weights), which needs servers on this machine; agentrl rollout "
                                "works with any server")])

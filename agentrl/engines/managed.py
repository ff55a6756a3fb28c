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

Where managed servers run (``engine.placement``): ``driver`` (the default) makes them subprocess
groups of the driver on its machine, which one machine needs; ``ray`` (``agentrl train``) places
each in a bundle of a Ray placement group, started by a host actor on whichever node Ray picks
(``engines/ray_servers.py``), with the lifeline owned by that actor. Ray-placed servers load
synced weights from the run directory, so on several nodes it must be shared storage.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

from agentrl.config.schema import EngineConfig, TrainConfig
from agentrl.engines.guard import new_api_key
from agentrl.engines.launch import (
    LaunchedServers,
    ServerProcess,
    ServerSpec,
    launch_servers,
    serve_specs,
    sglang_specs,
    with_lifeline,
)
from agentrl.engines.ray_servers import RayPlacement, RayServer
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


def managed_specs(engine: EngineConfig, model_path: str | Path, *, threads: int = 1,
                  addresses: Sequence[tuple[str, int]] | None = None) -> list[ServerSpec]:
    """The ``engine.num_servers`` servers of the config, without their lifeline (see ``with_lifeline``).
    ``addresses``: (host, port) of each server (Ray-placed servers listen on their node's address);
    default: this machine's loopback, free ports."""
    if addresses is None:
        return _specs(engine, model_path, threads=threads, num_servers=engine.num_servers)
    api_key = new_api_key()  # one key for the launch, whichever node a server is on
    return [spec for host, port in addresses
            for spec in _specs(engine, model_path, threads=threads, num_servers=1, host=host, ports=[port], api_key=api_key)]


def _specs(engine: EngineConfig, model_path: str | Path, *, threads: int, num_servers: int, **where: Any) -> list[ServerSpec]:
    extra = [*_typed_flags(engine), *engine.launch_args]
    if engine.launcher == "agentrl":
        return serve_specs(model_path, num_servers=num_servers, threads=threads, extra_args=engine.launch_args, **where)
    if engine_device(engine) == "cpu":
        from agentrl.engines.sglang_cpu.env import unavailable_reason, venv_dir
        from agentrl.engines.sglang_cpu.server import sglang_cpu_specs

        if engine.tp_size != 1:
            raise ConfigError([("engine.tp_size", f"{engine.tp_size}: tensor parallelism needs GPUs; on a CPU it is 1")])
        if engine.python is None and (reason := unavailable_reason(venv_dir())) is not None:
            raise EngineUnavailable(f"engine=sglang on a CPU needs the cached SGLang venv: {reason}")
        specs = sglang_cpu_specs(model_path, num_servers=num_servers, threads=threads,
                                 max_total_tokens=engine.max_total_tokens or 65536, extra_args=extra, **where)
        if engine.python is not None:
            specs = [replace(s, command=[engine.python, *s.command[1:]]) for s in specs]
        return specs
    if engine.max_total_tokens is not None:
        extra += ["--max-total-tokens", str(engine.max_total_tokens)]
    return sglang_specs(model_path, num_servers=num_servers, tp_size=engine.tp_size,
                        python=engine.python or sys.executable, extra_args=extra, **where)


class ManagedServers:
    """The job's servers: started by ``start`` (all ready, or none left running), restarted by a
    watchdog thread when one dies, stopped by ``stop`` (idempotent; also a context manager).
    With a ``RayPlacement`` each server runs in its placement-group bundle under a host actor
    (``engines/ray_servers.py``), otherwise as a child process group of this process."""

    def __init__(self, specs: Sequence[ServerSpec], *, ready_timeout_s: float, log_dir: str | Path,
                 check_interval_s: float = 1.0, max_restarts: int = MAX_RESTARTS, placement: RayPlacement | None = None):
        # a Ray-placed server's lifeline is owned by its host actor, which adds it on its node
        self.specs = list(specs) if placement is not None else [with_lifeline(s) for s in specs]
        self.placement = placement
        self.ready_timeout_s, self.log_dir = ready_timeout_s, Path(log_dir)
        self.check_interval_s, self.max_restarts = check_interval_s, max_restarts
        self.servers: list[ServerProcess | RayServer] = []
        self.restarts = [0] * len(self.specs)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, model_path: str | Path, *, log_dir: str | Path, threads: int = 1) -> "ManagedServers":
        engine = cfg.engine
        if engine.placement == "driver":
            return cls(managed_specs(engine, model_path, threads=threads), ready_timeout_s=engine.ready_timeout_s, log_dir=log_dir)
        from agentrl.engines.ray_servers import RayPlacement

        gpus = engine.tp_size if engine_device(engine) == "cuda" else 0
        placement = RayPlacement(engine.num_servers, cpus=engine.cpus_per_server, gpus=gpus, strategy=engine.placement_strategy,
                                 timeout_s=engine.ready_timeout_s)
        try:
            specs = managed_specs(engine, model_path, threads=threads, addresses=placement.addresses())
        except BaseException:
            placement.stop([])
            raise
        return cls(specs, ready_timeout_s=engine.ready_timeout_s, log_dir=log_dir, placement=placement)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    @property
    def api_key(self) -> str | None:
        """The key the servers of this launch share (restarts keep it): what clients pass."""
        keys = {s.api_key for s in self.specs}
        return keys.pop() if len(keys) == 1 else None

    def start(self) -> "ManagedServers":
        if self.placement is not None:
            self.servers = list(self.placement.start(self.specs, ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir))
        else:
            self.servers = list(launch_servers(self.specs, ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir).servers)
        self._watchdog = threading.Thread(target=self._watch, name="agentrl-server-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=self.ready_timeout_s + 30)
        with self._lock:
            if self.placement is not None:
                self.placement.stop([s for s in self.servers if isinstance(s, RayServer)])
                self.placement = None  # stopped: a second stop has nothing left to do
            else:
                LaunchedServers([s for s in self.servers if isinstance(s, ServerProcess)]).stop()

    def __enter__(self) -> "ManagedServers":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_interval_s):
            for index, server in enumerate(list(self.servers)):
                if self._stopping.is_set() or self.restarts[index] >= self.max_restarts or server.alive():
                    continue
                if not self._stopping.is_set():  # a server that died because the job is stopping is not restarted
                    self._restart(index, server)

    def _restart(self, index: int, dead: ServerProcess | RayServer) -> None:
        self.restarts[index] += 1
        log.warning("server %s exited with %s; restarting it (%d/%d). Its log ends:\n%s", dead.url,
                    dead.returncode, self.restarts[index], self.max_restarts, dead.log_tail(10))
        dead.stop(grace_s=1.0)  # reap the group's leftovers
        dead.archive_log(str(self.restarts[index]))  # keep the dead server's log next to the new one's
        started = time.monotonic()
        new: ServerProcess | RayServer
        try:
            if self.placement is not None:
                new = self.placement.restart(index, self.specs[index], ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir)
            else:
                new = launch_servers([self.specs[index]], ready_timeout_s=self.ready_timeout_s, log_dir=self.log_dir).servers[0]
        except Exception as exc:  # noqa: BLE001 - the watchdog reports and goes on watching the others
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
    if engine.placement == "ray" and not training:
        raise ConfigError([("engine.placement", "ray: Ray-placed servers are started by agentrl train, which runs Ray; "
                            "agentrl rollout starts its servers on this machine (placement=driver) or uses engine.servers")])
    if engine.placement == "ray" and engine.servers:
        raise ConfigError([("engine.placement", "ray places the servers agentrl starts; engine.servers names servers you "
                            "started - give one or the other")])
    if engine.weight_sync == "memory":
        raise ConfigError([("engine.weight_sync", "memory: SGLang servers are other processes; use disk (or auto)")])
    if engine.servers and training:
        remote = [url for url in engine.servers if urlparse(url).hostname not in LOCAL_HOSTS]
        if remote:
            raise ConfigError([("engine.servers", f"{remote}: agentrl train syncs weights by disk (the servers load "
                                "<run dir>/engine_weights), which needs servers on this machine; agentrl rollout "
                                "works with any server")])

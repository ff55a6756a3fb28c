"""Managed servers placed by Ray (``engine.placement=ray``): one placement-group bundle per server.

Each server's process group is started by a small Ray actor, ``ServerHost``, scheduled into its
own bundle of the job's placement group (``engine.cpus_per_server`` CPUs, and ``engine.tp_size``
GPUs when the servers run on GPUs; ``engine.placement_strategy`` spreads or packs the bundles over
the cluster's nodes). The host runs the server under ``agentrl.engines.lifeline`` with *itself* as
the owner, so a server ends with its host actor: when the driver ends (Ray kills the actors a
driver owns, a SIGKILLed driver included), when the actor is killed, and when its node is lost.
The server listens on its node's address, with the launch's API key.

``ManagedServers`` drives these hosts as it drives local servers: ``RayServer`` has the interface
of ``launch.ServerProcess`` that the watchdog uses (``alive``, ``stop``, ``log_tail``). A server
whose process dies is restarted by its host; a host that died (killed, or its node lost) is
replaced by a new host in the same bundle, which Ray reschedules onto a live node. The server's
URL is its node's address, so a server that comes back on another node has another URL: that
server is reported and left out of rotation rather than restarted under a URL no client knows.

Every call on a host has a timeout (``HOST_CALL_TIMEOUT_S``, or the start-up timeout for
``start``), and a placement group that cannot be placed fails after ``engine.ready_timeout_s``
with what it asked for and what the cluster has.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentrl.engines.launch import ServerSpec, free_port
from agentrl.errors import EngineUnavailable

__all__ = ["ServerHost", "RayServer", "RayPlacement", "HOST_CALL_TIMEOUT_S"]

HOST_CALL_TIMEOUT_S = 60.0


class ServerHost:
    """Ray actor (created through ``RayPlacement``) that owns one server's process group on its node."""

    def __init__(self) -> None:
        self.server: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the server's spec."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def pid(self) -> int:
        return os.getpid()

    def start(self, spec: ServerSpec, ready_timeout_s: float, log_dir: str) -> int:
        """Start the server with this actor as its lifeline's owner; return its process-group id once ready."""
        from agentrl.engines.launch import launch_servers, with_lifeline

        self.stop(grace_s=1.0)
        self.server = launch_servers([with_lifeline(spec, owner_pid=os.getpid())], ready_timeout_s=ready_timeout_s,
                                     log_dir=log_dir).servers[0]
        return int(self.server.process.pid)

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def returncode(self) -> int | None:
        return None if self.server is None else self.server.process.returncode

    def log_tail(self, lines: int) -> str:
        return "" if self.server is None else str(self.server.log_tail(lines))

    def archive_log(self, suffix: str) -> None:
        if self.server is not None and self.server.log_path.exists():
            self.server.log_path.rename(self.server.log_path.with_suffix(f".log.{suffix}"))

    def stop(self, grace_s: float = 10.0) -> None:
        if self.server is not None:
            self.server.stop(grace_s=grace_s)


class RayServer:
    """The driver's handle on a server a ``ServerHost`` runs (the interface ``ManagedServers`` uses)."""

    def __init__(self, host: Any, spec: ServerSpec, pgid: int):
        self.host, self.spec, self.pgid = host, spec, pgid
        self.url = spec.url

    def _call(self, method: str, *args: Any, timeout_s: float = HOST_CALL_TIMEOUT_S) -> Any:
        import ray

        return ray.get(getattr(self.host, method).remote(*args), timeout=timeout_s)

    def alive(self) -> bool:
        try:
            return bool(self._call("alive"))
        except Exception:  # noqa: BLE001 - the host is gone or unreachable (or Ray with it): so is its server
            return False

    @property
    def returncode(self) -> int | None:
        try:
            return self._call("returncode")  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - a lost host has no return code to give
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return str(self._call("log_tail", lines))
        except Exception as exc:  # noqa: BLE001 - the log is on a host that may be gone
            return f"(log unavailable: the server's host is gone: {type(exc).__name__})"

    def archive_log(self, suffix: str) -> None:
        try:
            self._call("archive_log", suffix)
        except Exception:  # noqa: BLE001
            pass

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            self._call("stop", grace_s, timeout_s=grace_s + HOST_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - stopping what is already gone
            pass


class RayPlacement:
    """The job's placement group (one bundle per server) and the host actor of each bundle."""

    def __init__(self, num_servers: int, *, cpus: float, gpus: int, strategy: str, timeout_s: float):
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            raise EngineUnavailable("engine.placement=ray needs Ray running in this process (agentrl train starts it)")
        self.cpus, self.gpus = cpus, gpus
        bundle: dict[str, float] = {"CPU": cpus, **({"GPU": float(gpus)} if gpus else {})}
        self.group = placement_group([bundle] * num_servers, strategy=strategy, name="")
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.group)
            raise EngineUnavailable(
                f"engine.placement=ray: {num_servers} server bundle(s) of {bundle} ({strategy}) could not be placed within "
                f"{timeout_s:g}s (engine.ready_timeout_s); the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free. Lower engine.cpus_per_server or engine.num_servers, or add nodes."
            ) from None
        self.hosts = [self.new_host(i) for i in range(num_servers)]

    def new_host(self, index: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(ServerHost).options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_concurrency=4, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
        )
        return actor.remote()

    def addresses(self) -> list[tuple[str, int]]:
        import ray

        return list(ray.get([h.address.remote() for h in self.hosts], timeout=HOST_CALL_TIMEOUT_S))

    def start(self, specs: list[ServerSpec], *, ready_timeout_s: float, log_dir: Path) -> list[RayServer]:
        """Start every bundle's server and wait for all; on any failure stop them all and raise."""
        import ray

        specs = [self._for_host(s) for s in specs]
        pending = [h.start.remote(s, ready_timeout_s, str(log_dir)) for h, s in zip(self.hosts, specs)]
        try:
            pgids = ray.get(pending, timeout=ready_timeout_s + HOST_CALL_TIMEOUT_S)
        except Exception as exc:
            for host in self.hosts:
                ray.kill(host)
            if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, EngineUnavailable):
                raise exc.cause from None  # the server's own start-up error, with its log tail
            raise EngineUnavailable(f"engine.placement=ray: starting the servers failed: {exc}") from exc
        return [RayServer(h, s, pgid) for h, s, pgid in zip(self.hosts, specs, pgids)]

    def restart(self, index: int, spec: ServerSpec, *, ready_timeout_s: float, log_dir: Path) -> RayServer:
        """Start bundle ``index``'s server again: on its host, or on a new host if that one is gone."""
        import ray

        host = self.hosts[index]
        try:
            ray.get(host.pid.remote(), timeout=HOST_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.kill(host)
            host = self.hosts[index] = self.new_host(index)
            ip, _ = ray.get(host.address.remote(), timeout=ready_timeout_s)
            if ip != spec.host:
                raise EngineUnavailable(f"server {spec.url}: its bundle was rescheduled onto node {ip}; a server's URL "
                                        "cannot move, so it stays out of rotation")
        spec = self._for_host(spec)
        try:
            pgid = ray.get(host.start.remote(spec, ready_timeout_s, str(log_dir)), timeout=ready_timeout_s + HOST_CALL_TIMEOUT_S)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, EngineUnavailable):
                raise exc.cause from None
            raise
        return RayServer(host, spec, pgid)

    def _for_host(self, spec: ServerSpec) -> ServerSpec:
        # Ray sets CUDA_VISIBLE_DEVICES for the host to its bundle's GPUs; the spec's own choice
        # (GPUs counted from 0 on the driver's machine) must not override it
        return replace(spec, env={k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"})

    def stop(self, servers: list[RayServer], grace_s: float = 10.0) -> None:
        import ray

        for server in servers:
            server.stop(grace_s)
        for host in self.hosts:
            ray.kill(host)
        ray.util.remove_placement_group(self.group)

"""OpenEnv environments: a server per worker, one client session per trajectory.

An OpenEnv environment (``pip install openenv``; ``openenv.core``) is a server: an ``Environment``
subclass with ``reset``/``step``/``state`` and typed ``Action``/``Observation`` models (each
observation carries ``reward`` and ``done``), served by OpenEnv's ``create_app`` over HTTP and a
WebSocket, used through an ``EnvClient``. agentrl drives it as a user's agent would:

* **server**: ``environment.openenv.url`` names a running one; else agentrl starts one per worker
  process (``agentrl.environments.openenv_serve``: uvicorn on a free port of 127.0.0.1), waits for
  its ``GET /health`` (``start_timeout_s``), restarts it when it died or stopped answering, and
  stops it when the worker ends. ``environment.name`` names what to serve: the app the
  environment's ``server/app.py`` builds, or its ``Environment`` subclass.
* **session**: each trajectory opens its own WebSocket session through OpenEnv's
  ``GenericEnvClient`` (its own environment instance on the server), at most
  ``max_sessions`` at once per server, and calls ``reset(**args)`` with the row's
  ``extra_info.environment.args`` (else the config's ``environment.args``).
* **actions** (``ActionSpec``, from the server's ``GET /schema``): an action with one string field
  takes the model's reply text (``text``); OpenEnv's ``CallToolAction`` (an ``MCPEnvironment``)
  offers the environment's MCP tools (``mcp``); any other action is one tool whose parameters are
  the action's fields (``tool``), called with the model's tool calls.
* **failures**: a server that cannot start, dies, or does not answer within ``step_timeout_s``,
  and an exception in the environment's code, end the trajectory with ``environment_error``
  (``EnvironmentFailure``, the waiter and what it waited for in the message).

The loop that uses all this is ``agentrl_agent_loops.openenv_env``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from agentrl.config.schema import OpenEnvEnvironmentConfig
from agentrl.data.row import EnvironmentRef
from agentrl.environments.spec import cached, resolve
from agentrl.errors import EnvironmentFailure, PluginError

__all__ = ["ActionSpec", "EnvironmentFailure", "OpenEnvServer", "OpenEnvSession", "action_spec", "mcp_result", "mcp_tools",
           "observation_text", "server_for", "stop_all_servers"]


# EnvironmentFailure's kinds here: ``server_start`` (it did not start or answer ``/health``),
# ``server_lost`` (the connection failed or closed: a server that died), ``timeout`` (no answer
# within ``step_timeout_s``), ``env_exception`` (the environment's code raised), ``no_session``
# (no session free within ``agent.trajectory_timeout_s``), ``bad_action`` / ``bad_observation``
# (the action or observation cannot be mapped: see ``action_spec``, ``observation_text``).


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class ActionSpec:
    """How the model's turn becomes the environment's action.

    ``text``: the reply text goes into the action's one string field ``text_field``. ``tool``: the
    action is a tool named ``tool_name`` whose parameters are the action's fields (``tool``).
    ``mcp``: the action is OpenEnv's ``CallToolAction`` (an ``MCPEnvironment``): the tools are the
    environment's MCP tools, listed per session (``list_tools``), each call a ``call_tool`` step."""

    mode: str  # "text" | "tool" | "mcp"
    text_field: str | None = None
    tool: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_name(self) -> str:
        return str(self.tool["function"]["name"]) if self.tool else ""

    def tools(self) -> list[dict[str, Any]]:
        return [self.tool] if self.mode == "tool" else []


def _snake(title: str) -> str:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", title).lower()
    name = re.sub(r"_?action$", "", words).strip("_")
    return re.sub(r"[^a-z0-9_]", "_", name) or "step"


def action_spec(schema: dict[str, Any], mode: str = "auto") -> ActionSpec:
    """The ``ActionSpec`` of an action JSON schema (``GET /schema``'s ``action``): ``auto`` picks
    ``mcp`` for OpenEnv's ``CallToolAction``, ``text`` for an action whose only field (``metadata``
    aside) is a required string, else ``tool``."""
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    if mode == "auto" and {"tool_name", "arguments"} <= set(properties) and properties.get("type", {}).get("const") == "call_tool":
        return ActionSpec(mode="mcp")
    required = [k for k in schema.get("required") or [] if k in properties]
    if not properties:
        raise EnvironmentFailure(f"the OpenEnv action {schema.get('title', '?')!r} has no fields the model could fill",
                                 "bad_action")
    only = next(iter(properties)) if len(properties) == 1 else None
    textual = only is not None and properties[only].get("type") == "string"
    if mode == "auto":
        mode = "text" if textual and only in required else "tool"
    if mode == "text":
        if not textual:
            raise EnvironmentFailure(f"environment.openenv.action=text needs an action with one string field; "
                                     f"{schema.get('title', '?')!r} has {sorted(properties)}", "bad_action")
        return ActionSpec(mode="text", text_field=only)
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if schema.get("$defs"):
        parameters["$defs"] = schema["$defs"]
    description = str(schema.get("description") or f"Act in the environment ({schema.get('title', 'Action')}).").strip()
    tool = {"type": "function", "function": {"name": _snake(str(schema.get("title") or "step")),
                                             "description": description, "parameters": parameters}}
    return ActionSpec(mode="tool", tool=tool)


def observation_text(observation: dict[str, Any], field_name: str | None = None) -> str:
    """What the model is shown of an observation (``reward``, ``done`` and ``metadata`` aside):
    ``field_name``'s value, else the value of its only field, else its fields as JSON (nothing for
    an observation without fields)."""
    fields = {k: v for k, v in observation.items() if k not in ("metadata", "reward", "done")}
    if not fields and field_name is None:
        return ""
    if field_name is not None:
        if field_name not in fields:
            raise EnvironmentFailure(f"environment.openenv.observation_field={field_name!r}: the observation has "
                                     f"{sorted(fields)}", "bad_observation")
        value = fields[field_name]
    elif len(fields) == 1:
        value = next(iter(fields.values()))
    else:
        return json.dumps(fields, ensure_ascii=False)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def mcp_tools(observation: dict[str, Any]) -> list[dict[str, Any]]:
    """An MCP environment's ``ListToolsObservation`` as chat-template tool schemas."""
    return [{"type": "function", "function": {"name": str(t["name"]), "description": str(t.get("description") or ""),
                                              "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}}
            for t in observation.get("tools") or []]


def mcp_result(observation: dict[str, Any]) -> tuple[str, str | None]:
    """What the model is shown of a ``CallToolObservation``, and the tool's error type (None: no error):
    the text parts of the MCP result, else its data as JSON."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error)}", str(error.get("error_type") or "execution_error")
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [str(c.get("text", "")) for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
        if texts:
            return "\n".join(texts), None
        result = result.get("data", result)
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)), None


# ----------------------------------------------------------------------------- the server
_SERVERS: list["OpenEnvServer"] = []


def stop_all_servers() -> None:
    """Stop every server this process started (at exit, and in tests)."""
    for server in list(_SERVERS):
        server.stop()


atexit.register(stop_all_servers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OpenEnvServer:
    """The OpenEnv server of one environment in this worker process: a process agentrl started
    (and restarts) or, with ``settings.url``, a user's server."""

    def __init__(self, name: str, settings: OpenEnvEnvironmentConfig):
        self.name = name
        self.max_sessions, self.action_mode = settings.max_sessions, settings.action
        self.start_timeout_s, self.step_timeout_s = settings.start_timeout_s, settings.step_timeout_s
        self.own = settings.url is None
        self.url: str | None = None if self.own else str(settings.url).rstrip("/")
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0  # starts so far
        self.broken = False  # a trajectory found it dead or unresponsive: the next one restarts it
        self.action: ActionSpec | None = None
        self._log: Any = None
        self._per_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[asyncio.Lock, asyncio.Semaphore]]" = (
            weakref.WeakKeyDictionary())
        self._thread_lock = threading.Lock()
        _SERVERS.append(self)

    def _primitives(self) -> tuple[asyncio.Lock, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        with self._thread_lock:
            if loop not in self._per_loop:
                self._per_loop[loop] = (asyncio.Lock(), asyncio.Semaphore(self.max_sessions))
            return self._per_loop[loop]

    @property
    def sessions(self) -> asyncio.Semaphore:
        return self._primitives()[1]

    def alive(self) -> bool:
        return not self.own or (self.process is not None and self.process.poll() is None)

    async def ensure(self) -> int:
        """Have the server up (start it, or restart it when it died or was found broken); returns
        how many restarts this call made (0 or 1). A failed start is an ``EnvironmentFailure``."""
        lock, _ = self._primitives()
        async with lock:
            if self.action is not None and self.alive() and not self.broken:
                return 0
            restart = self.generation > 0 and self.own
            if self.own:
                await asyncio.to_thread(self._start)
            self.action = action_spec(await asyncio.to_thread(self._schema), self.action_mode)
            self.broken = False
            return 1 if restart else 0

    def _start(self) -> None:
        self.stop()
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "agentrl.environments.openenv_serve", self.name, "--port", str(port),
               "--parent-pid", str(os.getpid()), "--max-sessions", str(self.max_sessions)]
        env = dict(os.environ)
        # the server imports what this process imports (a test's module, a user's package beside it)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.generation += 1
        deadline = time.monotonic() + self.start_timeout_s
        import httpx

        while True:
            code = self.process.poll()
            if code is not None:
                tail = self._log_tail()
                self.stop()
                raise EnvironmentFailure(f"the OpenEnv server of {self.name!r} exited with code {code} before it answered "
                                         f"GET /health:\n{tail}", "server_start")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=not self.own).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise EnvironmentFailure(f"agentrl waited environment.openenv.start_timeout_s={self.start_timeout_s:g} s "
                                         f"for the OpenEnv server of {self.name!r} to answer GET {self.url}/health; it did "
                                         f"not:\n{tail}", "server_start")
            time.sleep(0.1)

    def _schema(self) -> dict[str, Any]:
        import httpx

        try:
            response = httpx.get(f"{self.url}/schema", timeout=self.step_timeout_s, trust_env=not self.own)
            response.raise_for_status()
            return dict(response.json()["action"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise EnvironmentFailure(f"agentrl asked the OpenEnv server of {self.name!r} for GET {self.url}/schema: "
                                     f"{type(exc).__name__}: {exc}", "server_start") from exc

    def _log_tail(self, chars: int = 2000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def healthy(self) -> bool:
        """Whether the server is alive and answers ``GET /health`` within two seconds."""
        if not self.alive():
            return False
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, trust_env=not self.own).status_code == 200
        except httpx.HTTPError:
            return False

    async def check(self, generation: int) -> None:
        """After a failure in a session of start ``generation``: a dead or unresponsive server of
        agentrl's is stopped and marked for a restart by the next trajectory."""
        if not self.own or generation != self.generation or self.broken:
            return
        if not await asyncio.to_thread(self.healthy):
            self.broken = True
            await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None


def server_for(ref: EnvironmentRef, settings: OpenEnvEnvironmentConfig) -> OpenEnvServer:
    """This process's server of ``ref.name``, or the one at ``settings.url`` (one per name or URL,
    whatever a row's args)."""
    from agentrl.environments.openenv_serve import servable
    if settings.url is None:  # a missing package or a name of something else fails here, before any process starts
        try:
            servable(resolve(ref), str(ref.name))
        except TypeError as exc:
            raise PluginError(str(exc)) from exc
    # a server given by URL is one server whatever the rows name, and named by its URL in errors
    key = EnvironmentRef(library="openenv", name=None if settings.url else ref.name)
    return cached(key, lambda r: OpenEnvServer(str(settings.url or r.name), settings), kind=f"server:{settings.url}")


# ----------------------------------------------------------------------------- a session
@dataclass
class StepOutcome:
    observation: dict[str, Any]
    reward: float
    done: bool


class OpenEnvSession:
    """One trajectory's session: a slot of the server, a connected ``GenericEnvClient``, reset."""

    def __init__(self, server: OpenEnvServer, waiter: str):
        self.server, self.waiter = server, waiter
        self.client: Any = None
        self.tools: list[dict[str, Any]] = []  # an MCP environment's tools (ActionSpec mode mcp)
        self.generation = 0
        self.restarts = 0
        self._slot = False

    async def open(self, reset_args: dict[str, Any], wait_s: float) -> StepOutcome:
        server = self.server
        try:
            await asyncio.wait_for(server.sessions.acquire(), wait_s)
        except asyncio.TimeoutError:
            raise EnvironmentFailure(f"{self.waiter} waited {wait_s:g} s (agent.trajectory_timeout_s) for a session of the "
                                     f"OpenEnv server of {server.name!r} (environment.openenv.max_sessions="
                                     f"{server.max_sessions} in use)", "no_session") from None
        self._slot = True
        self.restarts = await server.ensure()
        self.generation = server.generation
        from openenv.core import GenericEnvClient

        timeout = server.step_timeout_s
        self.client = GenericEnvClient(base_url=server.url, connect_timeout_s=timeout, message_timeout_s=timeout)
        await self._call("connect", self.client.connect)
        first = await self._call("reset", lambda: self.client.reset(**reset_args))
        if server.action is not None and server.action.mode == "mcp":
            listed = await self._call("list_tools", lambda: self.client.step({"type": "list_tools"}))
            self.tools = mcp_tools(listed.observation)
            if not self.tools:
                raise EnvironmentFailure(f"the MCP environment {server.name!r} lists no tools "
                                         f"({listed.observation.get('metadata') or 'no error given'})", "bad_action")
        return first

    async def step(self, action: dict[str, Any]) -> StepOutcome:
        return await self._call("step", lambda: self.client.step(action))

    async def _call(self, what: str, call: Any) -> Any:
        server, timeout = self.server, self.server.step_timeout_s
        try:
            # the client's own message timeout bounds each answer; this bounds the whole call
            result = await asyncio.wait_for(_awaited(call()), timeout + 5.0)
        except asyncio.TimeoutError:
            await server.check(self.generation)
            raise EnvironmentFailure(f"{self.waiter} waited environment.openenv.step_timeout_s={timeout:g} s for {what} "
                                     f"from the OpenEnv server of {server.name!r} at {server.url}; no answer", "timeout") from None
        except RuntimeError as exc:  # the client's "Server error: ... (code: ...)": the environment's code raised
            raise EnvironmentFailure(f"{what} on the OpenEnv server of {server.name!r} failed: {exc}", "env_exception") from exc
        except Exception as exc:  # the connection: refused, closed by a server that died
            await server.check(self.generation)
            raise EnvironmentFailure(f"{self.waiter} lost the OpenEnv server of {server.name!r} at {server.url} during "
                                     f"{what}: {type(exc).__name__}: {exc}", "server_lost") from exc
        if what == "connect":
            return None
        reward = result.reward
        return StepOutcome(observation=dict(result.observation or {}), reward=float(reward) if reward is not None else 0.0,
                           done=bool(result.done))

    async def close(self) -> None:
        """Close the session (at most ten seconds for a polite close) and free its slot, always."""
        client, self.client = self.client, None
        try:
            if client is not None:
                await asyncio.wait_for(_awaited(client.close()), 10.0)
        except Exception:  # a dead server's socket (or a timeout): nothing to close politely
            pass
        finally:
            if self._slot:
                self._slot = False
                self.server.sessions.release()


async def _awaited(value: Any) -> Any:
    return await value

"""The server process agentrl starts for an OpenEnv environment (one per worker).

``python -m agentrl.environments.openenv_serve NAME --port PORT --parent-pid PID --max-sessions K``

``NAME`` is ``environment.name`` (an entry point in group ``agentrl.environments``, ``pkg.mod:attr``
or ``pkg.mod``, found by ``agentrl.environments.spec.resolve``). What it names is served by uvicorn
on 127.0.0.1, through OpenEnv's own server code:

* a FastAPI app (what an environment's ``server/app.py`` builds with OpenEnv's ``create_app``, and
  its ``openenv.yaml`` names as ``app:``), as it is; a module stands for its ``app``;
* an ``Environment`` subclass, through ``create_app``: its action and observation classes are the
  annotations of its ``step``; ``max_concurrent_envs`` is ``K`` when the class declares
  ``SUPPORTS_CONCURRENT_SESSIONS``, else 1 (as OpenEnv requires).

The process ends itself within a second of its parent's end, so a worker that dies without
cleaning up leaves no server behind.

OpenEnv's package imports its Gradio web interface eagerly (``openenv.core.env_server`` imports
``web_interface``, which imports gradio: most of a server's start), though ``create_app`` mounts it
only with ``ENABLE_WEB_INTERFACE`` set. ``defer_openenv_web_ui`` (an import hook, installed here,
and in every process that imports ``agentrl.environments``: the driver, the workers) defers it to
its first use: without ``ENABLE_WEB_INTERFACE`` the package imports as it does where gradio is
absent, and ``create_web_interface_app`` / ``WebInterfaceManager`` import the web interface when
first looked up, from the package or the module, so an app that builds its own web interface
still gets it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading
import time
import types
import typing
from typing import Any

__all__ = ["app_for", "defer_openenv_web_ui", "servable", "main"]

_WEB_UI = "openenv.core.env_server.web_interface"
_WEB_UI_NAMES = ("create_web_interface_app", "WebInterfaceManager")


def defer_openenv_web_ui() -> None:
    """From now on in this process, openenv's first import (``openenv.core``) leaves its web
    interface (and gradio) for its first use: an import hook that costs nothing until then. A
    no-op when openenv is imported already; at the import, ``ENABLE_WEB_INTERFACE`` set makes
    openenv import as it does."""
    if "openenv.core" in sys.modules or any(isinstance(f, _DeferWebUI) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferWebUI())


def _web_ui_wanted() -> bool:
    return os.getenv("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")


class _DeferWebUI(importlib.abc.MetaPathFinder):
    """Finds ``openenv.core`` as the other finders do, with a loader that imports it without its
    web interface; then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "openenv.core":
            return None
        sys.meta_path.remove(self)  # once: a package is imported once per process
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or _web_ui_wanted():
            return spec
        spec.loader = _WithoutWebUI(spec.loader)
        return spec


class _WithoutWebUI(importlib.abc.Loader):
    """``openenv.core``'s loader, run with ``web_interface`` unimportable (the package's own
    ``try: from .web_interface import ...`` then takes its no-gradio branch), its web-interface
    names then imported at first lookup (``_defer_web_ui``)."""

    def __init__(self, loader: Any):
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # resources, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[_WEB_UI] = None  # type: ignore[assignment]
        try:
            self._loader.exec_module(module)
        finally:
            if _WEB_UI in sys.modules and sys.modules[_WEB_UI] is None:
                del sys.modules[_WEB_UI]
        _defer_web_ui(sys.modules["openenv.core.env_server"])
        _defer_web_ui(module)


def _defer_web_ui(module: types.ModuleType) -> None:
    """``module``'s web-interface names (None after the deferred import) imported at first lookup."""
    namespace = vars(module)
    for name in _WEB_UI_NAMES:
        if name in namespace and namespace[name] is None:
            del namespace[name]
    before = namespace.get("__getattr__")

    def __getattr__(name: str) -> Any:
        if name in _WEB_UI_NAMES:
            return getattr(importlib.import_module(_WEB_UI), name)
        if before is not None:
            return before(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    namespace["__getattr__"] = __getattr__


def servable(obj: Any, name: str) -> Any:
    """What ``name`` resolved to, as the app or the ``Environment`` subclass to serve; anything
    else is a ``TypeError`` saying what to name instead (checked before a process starts too)."""
    from openenv.core.env_server.interfaces import Environment

    if isinstance(obj, types.ModuleType):
        if not hasattr(obj, "app"):
            raise TypeError(f"OpenEnv environment {name!r} is a module without an `app`: name the app or the "
                            "Environment class as pkg.mod:attr")
        obj = obj.app
    if inspect.isclass(obj) and issubclass(obj, Environment):
        _step_types(obj, name)
        return obj
    if callable(obj) and hasattr(obj, "router"):  # a FastAPI / Starlette app
        return obj
    raise TypeError(f"OpenEnv environment {name!r} is a {type(obj).__name__}: name a FastAPI app built with "
                    "openenv's create_app (server/app.py:app) or an openenv Environment subclass")


def app_for(obj: Any, name: str, max_sessions: int) -> Any:
    """The ASGI app that serves ``obj`` (what ``name`` resolved to)."""
    from openenv.core.env_server.http_server import create_app

    obj = servable(obj, name)
    if inspect.isclass(obj):
        action_cls, observation_cls = _step_types(obj, name)
        concurrent = max_sessions if getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
        return create_app(obj, action_cls, observation_cls, env_name=obj.__name__, max_concurrent_envs=concurrent)
    return obj


def _step_types(cls: type, name: str) -> tuple[type, type]:
    """The Action and Observation classes of an Environment subclass, from ``step``'s annotations."""
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Action, Observation

    if issubclass(cls, MCPEnvironment):  # served as OpenEnv's MCP environments are: create_app(cls, CallToolAction, ...)
        return CallToolAction, CallToolObservation
    hints = typing.get_type_hints(cls.step)
    params = [p for p in inspect.signature(cls.step).parameters if p != "self"]
    action = hints.get(params[0]) if params else None
    observation = hints.get("return")
    if not (inspect.isclass(action) and issubclass(action, Action)):
        raise TypeError(f"OpenEnv environment {name!r}: annotate {cls.__name__}.step's action with its Action subclass "
                        "(or name the app that create_app built)")
    if not (inspect.isclass(observation) and issubclass(observation, Observation)):
        raise TypeError(f"OpenEnv environment {name!r}: annotate {cls.__name__}.step's return with its Observation subclass "
                        "(or name the app that create_app built)")
    return action, observation


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentrl.environments.openenv_serve")
    parser.add_argument("name")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=1)
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()

    import uvicorn

    from agentrl.environments.spec import EnvironmentRef, resolve

    defer_openenv_web_ui()
    obj = resolve(EnvironmentRef(library="openenv", name=args.name))
    app = app_for(obj, args.name, args.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", ws_ping_interval=None)


if __name__ == "__main__":
    sys.exit(main())

"""Naming an environment: the ref a row or the config carries, and finding what it names.

A row belongs to an environment through ``extra_info.environment = {library, name, args}``; a
row without one takes the config's ``environment`` section; a row with neither runs as it
would without environments. A row with a ref and no ``agent_name`` runs its library's loop
(``LIBRARY_LOOPS``). ``resolve(ref)`` finds what ``ref.name`` names: an entry point in group
``agentrl.environments`` (``agentrl plugins list`` shows them), else ``pkg.mod:attr``, else the
module ``pkg.mod``, else, for verifiers, the module its own id names as ``vf.load_environment``
reads it (``vf-calc-tool`` and ``owner/vf-calc-tool``: ``vf_calc_tool``). Each library's adapter turns that object into its library's thing (verifiers:
the module's ``load_environment(**args)``; trl: the class; openenv: the environment class or
client) and keeps one per process through ``cached``.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, TypeVar

from agentrl.config.environment_names import library_module
from agentrl.config.schema import ENVIRONMENT_EXTRAS, ENVIRONMENT_LOOPS, EnvironmentConfig, environment_import_hint
from agentrl.data.row import EnvironmentRef
from agentrl.errors import PluginError
from agentrl.plugins import PluginRegistry

__all__ = ["EnvironmentRef", "LIBRARY_LOOPS", "LIBRARY_EXTRAS", "resolve", "cached", "config_ref", "clear_cache"]

LIBRARY_LOOPS: dict[str, str] = ENVIRONMENT_LOOPS  # library -> the agent loop of its rows
LIBRARY_EXTRAS: dict[str, str] = ENVIRONMENT_EXTRAS  # library -> agentrl's extra that installs it

T = TypeVar("T")
_resolved: dict[tuple[str, str], Any] = {}
_built: dict[tuple[str, str | None, str, str], Any] = {}
_lock = threading.Lock()


def config_ref(config: EnvironmentConfig) -> EnvironmentRef | None:
    """The ref of the config's ``environment`` section (None when it names no library)."""
    return EnvironmentRef.from_config(config)


def resolve(ref: EnvironmentRef, registry: PluginRegistry | None = None) -> Any:
    """What ``ref.name`` names (an entry point, ``pkg.mod:attr`` or a module), imported once per
    process. A missing or failing import is a ``PluginError`` naming the module, the missing
    package and the extra that installs the library."""
    if ref.name is None:
        raise PluginError(f"the {ref.library} environment names nothing: set extra_info.environment.name or environment.name")
    key = (ref.library, ref.name)
    with _lock:
        if key in _resolved:
            return _resolved[key]
    registry = registry or PluginRegistry()
    try:
        obj = registry.load_object("environments", ref.name)
    except PluginError as exc:
        module = library_module(ref.library, ref.name)  # verifiers' own ids: vf-calc-tool is the module vf_calc_tool
        if module is None:
            raise PluginError(f"{ref.library} environment {ref.name!r} cannot be loaded: {exc} "
                              f"({environment_import_hint(ref.library, ref.name)})") from exc
        try:
            obj = registry.load_object("environments", module)
        except PluginError as own:
            raise PluginError(f"{ref.library} environment {ref.name!r} cannot be loaded: {ref.library} reads the id as "
                              f"the module {module!r}: {own} ({environment_import_hint(ref.library, module)})") from own
    with _lock:
        return _resolved.setdefault(key, obj)


def cached(ref: EnvironmentRef, build: Callable[[EnvironmentRef], T], *, kind: str = "") -> T:
    """One ``build(ref)`` per process for each (library, name, args, kind): an adapter's
    environment object (``kind`` tells apart several objects an adapter keeps per ref)."""
    key = (ref.library, ref.name, json.dumps(ref.args, sort_keys=True, default=repr), kind)
    with _lock:
        if key in _built:
            return _built[key]  # type: ignore[no-any-return]
    obj = build(ref)
    with _lock:
        return _built.setdefault(key, obj)  # type: ignore[no-any-return]


def clear_cache() -> None:
    """Forget resolved names and built environments (tests that redefine a module)."""
    with _lock:
        _resolved.clear()
        _built.clear()

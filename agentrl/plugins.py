"""Plugins: agent loops, tools, interactions, rewards and tool parsers, found by entry point.

Discovery reads installed package metadata (``importlib.metadata``), never a registry that a
module fills when it happens to be imported. Any process that can import agentrl - the driver,
a Ray actor, a subprocess - resolves the same names to the same objects. The built-ins are
declared in agentrl's own ``pyproject.toml`` exactly like a third-party package's. A worker on
another node of a cluster the job joined reads the driver's table instead (``PLUGIN_TABLE_ENV``).

A plugin is imported only when it is loaded, so a broken plugin fails alone, with an error
naming its distribution and entry point. Two distributions offering one name in one group are
an error until the config says which distribution wins (``plugins.prefer``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from agentrl.errors import PluginError

__all__ = [
    "PLUGIN_TABLE_ENV", "GROUPS", "ALIASES", "EXTRAS_BY_MODULE", "PluginSpec", "PluginRegistry", "discover", "refresh", "load_plugin",
    "missing_module", "install_hint",
]

GROUPS: tuple[str, ...] = (
    "agentrl.agent_loops",
    "agentrl.tools",
    "agentrl.interactions",
    "agentrl.rewards",
    "agentrl.data_source_rewards",  # name: a data source; value: its reward function (reward.by_data_source wins)
    "agentrl.tool_parsers",
    "agentrl.agents",
    "agentrl.environments",  # verifiers / OpenEnv / TRL environments (agentrl.environments.spec.resolve)
)

# verl's names for the built-in loops, accepted wherever a loop name is.
ALIASES: dict[str, dict[str, str]] = {
    "agentrl.agent_loops": {"single_turn_agent": "single_turn", "tool_agent_loop": "tool_agent", "react_agent": "react"},
}


@dataclass(frozen=True, slots=True)
class PluginSpec:
    group: str
    name: str
    target: str  # "module:attribute"
    distribution: str | None  # the installed distribution that declares it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _group_name(group: str) -> str:
    full = group if group.startswith("agentrl.") else f"agentrl.{group}"
    if full not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; groups are {', '.join(GROUPS)}")
    return full


# A driver that ships its code to other Ray nodes (``agentrl.trainer.shipping``) sends its plugin
# table in this variable: shipped modules carry no package metadata, and every node must resolve
# the names the driver resolved, to the same targets.
PLUGIN_TABLE_ENV = "AGENTRL_PLUGIN_TABLE"


@functools.lru_cache(maxsize=None)
def _scan() -> tuple[PluginSpec, ...]:
    shipped = os.environ.get(PLUGIN_TABLE_ENV)
    if shipped:
        return tuple(PluginSpec(**spec) for spec in json.loads(shipped))
    specs: dict[tuple[str, str, str | None], PluginSpec] = {}
    all_entry_points = metadata.entry_points()
    for ep in (ep for group in GROUPS for ep in all_entry_points.select(group=group)):
        dist = ep.dist.name if ep.dist is not None else None
        # the same distribution can be visible twice (e.g. an editable install plus a build dir)
        specs.setdefault((ep.group, ep.name, dist), PluginSpec(ep.group, ep.name, ep.value, dist))
    return tuple(sorted(specs.values(), key=lambda s: (s.group, s.name, s.distribution or "")))


def refresh() -> None:
    """Forget the scan of installed metadata (after installing a plugin in a running process)."""
    _scan.cache_clear()


def discover(group: str | None = None) -> list[PluginSpec]:
    """Every declared plugin (optionally of one group), without importing any of them."""
    specs = _scan()
    if group is None:
        return list(specs)
    full = _group_name(group)
    return [s for s in specs if s.group == full]


# Packages that agentrl's own plugins import and its base install leaves out, by top-level module:
# the extra of pyproject.toml that installs each (the agent programs under agent_programs/).
EXTRAS_BY_MODULE: dict[str, str] = {"openai": "openai", "agents": "agents"}


def missing_module(exc: BaseException) -> str | None:
    """The top-level module whose absence raised ``exc`` (or an exception ``exc`` was raised
    from), or None when no ``ModuleNotFoundError`` with a module name is in the chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ModuleNotFoundError) and current.name:
            return current.name.split(".")[0]
        current = current.__cause__ or current.__context__
    return None


def install_hint(module: str) -> str:
    """What to install for a missing top-level ``module``: agentrl's extra when one provides it."""
    extra = EXTRAS_BY_MODULE.get(module)
    where = f'pip install "agentrl[{extra}]"' if extra else "install the package that provides it"
    return f"the module {module!r} is not installed: {where}"


def _import_target(spec: PluginSpec) -> Any:
    try:
        return metadata.EntryPoint(spec.name, spec.target, spec.group).load()
    except Exception as exc:  # any failure inside a plugin's import is that plugin's problem
        module = missing_module(exc)  # a package the plugin imports, not the plugin's own module, is missing
        own = spec.target.split(":")[0].split(".")[0]
        hint = f" ({install_hint(module)})" if module is not None and module != own else ""
        raise PluginError(
            f"plugin {spec.name!r} in group {spec.group} (entry point {spec.name} = {spec.target}, "
            f"distribution {spec.distribution or 'unknown'}) failed to load: {type(exc).__name__}: {exc}{hint}"
        ) from exc


class PluginRegistry:
    """Resolves plugin names to loaded objects, with per-group distribution preferences."""

    def __init__(self, prefer: Mapping[str, Mapping[str, str]] | None = None):
        # prefer: {group: {plugin name: distribution that wins}}; groups may be short ("tools").
        self._prefer = {_group_name(g): dict(v) for g, v in (prefer or {}).items()}
        self._loaded: dict[tuple[str, str], Any] = {}
        self._import_problems: dict[tuple[str, str], str | None] = {}

    @property
    def prefer(self) -> dict[str, dict[str, str]]:
        """The distribution preferences this registry resolves with (full group names)."""
        return {group: dict(names) for group, names in self._prefer.items()}

    def names(self, group: str) -> list[str]:
        return sorted({s.name for s in discover(group)})

    def accepted_names(self, group: str) -> set[str]:
        """The installed names of ``group`` and the aliases (e.g. verl's) that resolve to them."""
        installed = set(self.names(group))
        aliases = ALIASES.get(_group_name(group), {})
        return installed | {alias for alias, name in aliases.items() if name in installed}

    def canonical(self, group: str, name: str) -> str:
        full = _group_name(group)
        return ALIASES.get(full, {}).get(name, name)

    def spec(self, group: str, name: str) -> PluginSpec:
        full = _group_name(group)
        name = self.canonical(full, name)
        candidates = [s for s in discover(full) if s.name == name]
        if not candidates:
            known = ", ".join(self.names(full)) or "none installed"
            raise PluginError(f"no plugin named {name!r} in group {full} (known: {known})")
        if len(candidates) > 1:
            wanted = self._prefer.get(full, {}).get(name)
            chosen = [s for s in candidates if s.distribution == wanted]
            if not chosen:
                dists = ", ".join(sorted(s.distribution or "unknown" for s in candidates))
                short = full.removeprefix("agentrl.")
                raise PluginError(
                    f"plugin name {name!r} in group {full} is offered by several distributions ({dists}); "
                    f"choose one with plugins.prefer.{short}.{name}=<distribution>"
                )
            candidates = chosen
        return candidates[0]

    def load(self, group: str, name: str) -> Any:
        spec = self.spec(group, name)
        key = (spec.group, spec.name)
        if key not in self._loaded:
            self._loaded[key] = _import_target(spec)
        return self._loaded[key]

    def load_object(self, group: str, name: str) -> Any:
        """What ``name`` names: an entry point of ``group``, else ``pkg.mod:attr``, else the
        module ``pkg.mod``. A missing or failing import is a ``PluginError`` that names the
        module and, when the import failed on another module, the package that is missing."""
        if name in self.names(group):
            return self.load(group, name)
        module, _, attr = name.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = exc.name or module
            if missing == module or module.startswith(missing + "."):
                known = ", ".join(self.names(group)) or "none installed"
                raise PluginError(f"{name!r} is neither an entry point in group {_group_name(group)} (known: {known}) "
                                  f"nor an importable module (no module named {missing!r})") from exc
            raise PluginError(f"module {module!r} (for {name!r}) failed to import: the package {missing.split('.')[0]!r} "
                              f"is not installed ({exc})") from exc
        except Exception as exc:  # any failure inside the module's import
            raise PluginError(f"module {module!r} (for {name!r}) failed to import: {type(exc).__name__}: {exc}") from exc
        for part in attr.split(".") if attr else ():
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise PluginError(f"module {module!r} has no attribute {attr!r} (for {name!r})") from None
        return obj

    def import_problem(self, group: str, name: str) -> str | None:
        """Why an installed plugin cannot be imported, or None when it imports (or is not
        installed: naming unknown plugins is the caller's membership check). Failures are
        remembered, so the data checks can ask once per row and import each plugin once."""
        key = (_group_name(group), name)
        if key not in self._import_problems:
            problem, canonical = None, self.canonical(group, name)
            if key[0] == "agentrl.environments":  # a module name is as good as an entry point here
                try:
                    self.load_object(group, name)
                except PluginError as exc:
                    problem = str(exc)
            elif canonical in self.names(group):
                try:
                    self.load(group, canonical)
                except PluginError as exc:
                    problem = str(exc)
            self._import_problems[key] = problem
        return self._import_problems[key]

    def check(self, group: str | None = None) -> list[tuple[PluginSpec, str | None]]:
        """Try to import every plugin (of ``group``); returns (spec, error message or None) for each."""
        results: list[tuple[PluginSpec, str | None]] = []
        for spec in discover(group):
            try:
                _import_target(spec)
                results.append((spec, None))
            except PluginError as exc:
                results.append((spec, str(exc)))
        return results


def load_plugin(group: str, name: str, prefer: Mapping[str, Mapping[str, str]] | None = None) -> Any:
    """Load one plugin by group and name (a convenience over ``PluginRegistry``)."""
    return PluginRegistry(prefer).load(group, name)

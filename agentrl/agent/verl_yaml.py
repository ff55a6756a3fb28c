"""verl's tool and interaction YAML files, run by agentrl's tool and interaction runtime.

A verl user points ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` (agentrl:
``agent.tool_config_path``) at a file like::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

and ``...interaction_config_path`` (``agent.interaction_config_path``) at::

    interaction:
      - name: gsm8k
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

Each ``tool_schema`` is what the model is offered (its name is the name rows use in
``extra_info.tools_kwargs`` and the model calls), whatever class runs it. ``class_name`` is one of

* a class of verl's own: mapped to the agentrl plugin with the same behaviour (``VERL_TOOLS``,
  ``VERL_INTERACTIONS``); a verl class without a counterpart is refused, naming it;
* the name of an installed agentrl plugin (``calculator``, ``gsm8k``): agentrl's own tools and
  interactions are configured the same way;
* a dotted path to a class: an agentrl ``Tool`` / ``Interaction`` subclass, or a class written
  against verl's interface (``create`` / ``execute`` / ``calc_reward`` / ``release`` keyed by
  instance id; ``start_interaction`` / ``generate_response`` / ``calculate_score`` /
  ``finalize_interaction``), run through an adapter. The config, and the code it names, are
  trusted like any plugin the user installs (see SECURITY.md).

The files are read and checked by ``agentrl.config.verl_files`` (before any model is loaded,
naming the file, the entry and the field); this module builds what they name.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.agent.tool import Tool, ToolResult
from agentrl.config.verl_files import InteractionSpec, ToolSpec
from agentrl.errors import ConfigError, ToolError
from agentrl.plugins import PluginRegistry

__all__ = ["VERL_TOOLS", "VERL_INTERACTIONS", "build_tool", "build_interaction", "VerlToolAdapter", "VerlInteractionAdapter"]

# verl's own classes -> (agentrl plugin with the same behaviour, config that makes it so)
VERL_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": ("gsm8k_answer", {}),
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": ("gsm8k_answer", {}),  # its path before verl 0.5
}
VERL_INTERACTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    # verl's code prefixes "#### " and scores flexibly (see agentrl_interactions.gsm8k)
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": ("gsm8k", {"method": "flexible"}),
}


def _import(dotted: str, key: str, where: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError([(key, f"{where}.class_name: cannot import {dotted!r}: {exc}")]) from exc


def _plugin_of(
    spec: ToolSpec | InteractionSpec, verl_classes: dict[str, tuple[str, dict[str, Any]]], registry: PluginRegistry,
    group: str, key: str,
) -> tuple[str | None, dict[str, Any]]:
    """The agentrl plugin (and the config that gives it verl's behaviour) that runs ``class_name``:
    a verl class of the table, or an installed plugin's name; None for a dotted path. A verl class
    without a counterpart is refused."""
    plugin, extra = verl_classes.get(spec.class_name, (None, {}))
    if plugin is None and spec.class_name.startswith("verl."):
        known = ", ".join(sorted(verl_classes))
        raise ConfigError([(key, f"{spec.where}.class_name: verl's {spec.class_name} has no agentrl counterpart (mapped: {known}); "
                                 f"give the dotted path of your own class or an agentrl {group[:-1]} plugin")])
    if plugin is None and spec.class_name in registry.names(group):
        plugin = spec.class_name
    return plugin, extra


def build_tool(spec: ToolSpec, registry: PluginRegistry, key: str = "agent.tool_config_path") -> Tool:
    """The tool object that runs ``spec`` (its schema is the spec's, applied by the ToolBox)."""
    plugin, extra = _plugin_of(spec, VERL_TOOLS, registry, "tools", key)
    if plugin is not None:
        return registry.load("tools", plugin)(**{**extra, **spec.config})
    cls = _import(spec.class_name, key, spec.where)
    if isinstance(cls, type) and issubclass(cls, Tool):
        return cls(**spec.config)
    if all(callable(getattr(cls, m, None)) for m in ("create", "execute", "release")):
        schema = spec.schema or {"type": "function", "function": {"name": spec.name, "parameters": {"type": "object"}}}
        return VerlToolAdapter(cls(spec.config, _Namespace.of(schema)), spec.name)
    raise ConfigError([(key, f"{spec.where}.class_name: {spec.class_name} is neither an agentrl Tool nor a class with verl's "
                             "tool interface (create, execute, calc_reward, release)")])


def build_interaction(spec: InteractionSpec, registry: PluginRegistry, key: str = "agent.interaction_config_path") -> Interaction:
    plugin, extra = _plugin_of(spec, VERL_INTERACTIONS, registry, "interactions", key)
    if plugin is not None:
        return registry.load("interactions", plugin)(**{**extra, **spec.config})
    cls = _import(spec.class_name, key, spec.where)
    if isinstance(cls, type) and issubclass(cls, Interaction):
        return cls(**spec.config)
    if all(callable(getattr(cls, m, None)) for m in ("start_interaction", "generate_response")):
        return VerlInteractionAdapter(cls({**spec.config, "name": spec.name}))
    raise ConfigError([(key, f"{spec.where}.class_name: {spec.class_name} is neither an agentrl Interaction nor a class with "
                             "verl's interaction interface (start_interaction, generate_response, calculate_score, finalize_interaction)")])


class _Namespace(dict):
    """verl hands tools their schema as a pydantic model; this gives attribute access
    (``tool_schema.function.name``) and ``model_dump()`` over the plain dict."""

    @classmethod
    def of(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return cls({k: cls.of(v) for k, v in value.items()})
        if isinstance(value, list):
            return [cls.of(v) for v in value]
        return value

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return json.loads(json.dumps(self))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class VerlToolAdapter(Tool):
    """A tool written against verl's interface, run as an agentrl tool.

    verl's ``create`` may return the instance id (or ``(id, response)``): agentrl keeps its own
    instance ids, so a different id the tool returns is remembered and used for its later calls.
    ``execute`` returns ``(response, step_reward, metrics)`` where ``response`` is text or an
    object with ``.text``."""

    parameters = {"type": "object"}

    def __init__(self, inner: Any, name: str):
        super().__init__()
        self.inner = inner
        self.name = name  # type: ignore[misc]
        self._ids: dict[str, str] = {}

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        created = await _maybe_await(self.inner.create(instance_id, **create_kwargs))
        if isinstance(created, tuple):
            created = created[0]
        self._ids[instance_id] = created if isinstance(created, str) else instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        out = await _maybe_await(self.inner.execute(self._ids.get(instance_id, instance_id), arguments, **execute_kwargs))
        response, reward, metrics = (tuple(out) + (None, None))[:3] if isinstance(out, tuple) else (out, None, None)
        text = response if isinstance(response, str) else getattr(response, "text", None)
        if text is None:
            raise ToolError(f"{self.name}: execute returned {type(response).__name__} without text")
        numeric = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return ToolResult(text=text, reward=None if reward is None else float(reward), metrics=numeric)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float | None:
        method = getattr(self.inner, "calc_reward", None)
        if method is None:
            return None
        value = await _maybe_await(method(self._ids.get(instance_id, instance_id), **kwargs))
        return None if value is None else float(value)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await _maybe_await(self.inner.release(self._ids.pop(instance_id, instance_id), **kwargs))


class VerlInteractionAdapter(Interaction):
    """An interaction written against verl's interface: ``generate_response`` returns
    ``(should_terminate, response, score, metadata)``."""

    def __init__(self, inner: Any):
        super().__init__()
        self.inner = inner
        self._ids: dict[str, str] = {}

    async def start(self, instance_id: str, **interaction_kwargs: Any) -> None:
        created = await _maybe_await(self.inner.start_interaction(instance_id, **interaction_kwargs))
        self._ids[instance_id] = created if isinstance(created, str) else instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionResponse:
        done, text, score, metadata = await _maybe_await(self.inner.generate_response(self._ids.get(instance_id, instance_id), messages))
        numeric = {k: float(v) for k, v in (metadata or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return InteractionResponse(done=bool(done), text=str(text or ""), reward=float(score or 0.0), metrics=numeric)

    async def calculate_score(self, instance_id: str) -> float | None:
        method = getattr(self.inner, "calculate_score", None)
        if method is None:
            return None
        value = await _maybe_await(method(self._ids.get(instance_id, instance_id)))
        return None if value is None else float(value)

    async def finalize(self, instance_id: str) -> None:
        method = getattr(self.inner, "finalize_interaction", None)
        if method is not None:
            await _maybe_await(method(self._ids.pop(instance_id, instance_id)))

"""verl's tool and interaction YAML files, read and checked (what they name is built by
``agentrl.agent.verl_yaml``).

A verl tool file is ``tools: [{class_name, config: {type: native, ...}, tool_schema: {type:
function, function: {name, description, parameters}}}]``; an interaction file is
``interaction: [{name, class_name, config}]``. Reading one checks its shape and reports every
problem at once, naming the file, the entry and the field, before any model is loaded; the
data checks use the names it defines (a row may name a tool that only the YAML defines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

__all__ = ["ToolSpec", "InteractionSpec", "read_tool_config", "read_interaction_config"]


@dataclass(frozen=True)
class ToolSpec:
    name: str  # what the model calls and rows name in tools_kwargs
    class_name: str  # a verl class, an agentrl plugin name or a dotted path
    config: dict[str, Any] = field(default_factory=dict)
    schema: dict[str, Any] | None = None  # the OpenAI function schema offered; None: the class's own
    where: str = ""  # "file: tools.0", for errors


@dataclass(frozen=True)
class InteractionSpec:
    name: str
    class_name: str
    config: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def _load_yaml(path: str, key: str) -> list[Any]:
    from omegaconf import OmegaConf

    file = Path(path)
    if not file.is_file():
        raise ConfigError([(key, f"file not found: {path}")])
    try:
        data = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception as exc:  # a YAML syntax error, named with the file
        raise ConfigError([(key, f"{path}: not valid YAML: {str(exc).splitlines()[0]}")]) from exc
    return data if isinstance(data, list) else [data]


def read_tool_config(path: str, key: str = "agent.tool_config_path") -> list[ToolSpec]:
    """The tools of a verl tool YAML file; every problem in the file at once."""
    [data] = _load_yaml(path, key)
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError([(key, f"{path}: needs a top-level `tools:` list")])
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}: tools.{i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            problems.append((key, f"{where}.class_name: missing (a verl class, an agentrl tool name or a dotted path)"))
            continue
        config = dict(entry.get("config") or {})
        if config.pop("type", "native") != "native":
            problems.append((key, f"{where}.config.type: only native tools are supported (MCP tools are not)"))
            continue
        schema = entry.get("tool_schema")
        name = None
        if schema is not None:
            function = schema.get("function") if isinstance(schema, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                problems.append((key, f"{where}.tool_schema.function.name: missing"))
                continue
            import jsonschema  # here: every run loads this module, only a tool file with schemas needs it

            try:
                jsonschema.Draft202012Validator.check_schema(function.get("parameters") or {"type": "object"})
            except jsonschema.SchemaError as exc:
                problems.append((key, f"{where}.tool_schema.function.parameters: not a JSON schema: {exc.message}"))
                continue
        specs.append(ToolSpec(name or entry["class_name"].rsplit(".", 1)[-1], entry["class_name"], config, schema, where))
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            problems.append((key, f"{spec.where}: tool name {spec.name!r} is also defined at {seen[spec.name]}"))
        seen.setdefault(spec.name, spec.where)
    if problems:
        raise ConfigError(problems)
    return specs


def read_interaction_config(path: str, key: str = "agent.interaction_config_path") -> list[InteractionSpec]:
    """The interactions of a verl interaction YAML file (``interaction:`` list of name/class/config)."""
    [data] = _load_yaml(path, key)
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError([(key, f"{path}: needs a top-level `interaction:` list")])
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}: interaction.{i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            problems.append((key, f"{where}.class_name: missing"))
            continue
        # verl names an interaction after its class when `name` is absent
        name = entry.get("name") or entry["class_name"].rsplit(".", 1)[-1].removesuffix("Interaction").lower()
        specs.append(InteractionSpec(str(name), entry["class_name"], dict(entry.get("config") or {}), where))
    if problems:
        raise ConfigError(problems)
    return specs

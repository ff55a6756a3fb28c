"""``--help`` and ``--cfg job`` for the config-driven commands (``train``, ``sft``, ``rollout``).

The help is made from what validates the config, so it cannot drift from it: the groups are the
folders of ``configs/`` and their YAML files, every key with its type comes from the pydantic
schema, the defaults shown are those of the composed preset (after any overrides given on the
same line), and each key's one-line doc is the comment written beside or above the field in
``agentrl/config/schema.py``, the one place a knob is documented.
"""

from __future__ import annotations

import ast
import inspect
import io
import tokenize
import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel

from agentrl.config import health, schema
from agentrl.config.loader import compose, config_dir, validate_config

__all__ = ["schema_docs", "config_keys", "key_rows", "command_groups", "command_help", "resolved_config_yaml", "config_command_main"]


def schema_docs() -> dict[str, str]:
    """``{"DataConfig.train_batch_size": "prompts per step", ...}``: each field's comment, taken
    from the end of its line, else from the comment lines right above it (``trainer.health``'s
    sections are written in ``agentrl/config/health.py``)."""
    return {**_field_comments(inspect.getsource(schema)), **_field_comments(inspect.getsource(health))}


def _field_comments(source: str) -> dict[str, str]:
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for field in node.body:
            if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
                continue
            text = comments.get(field.end_lineno or field.lineno)
            if text is None:  # a block of whole-line comments directly above the field
                above, line = [], field.lineno - 1
                while line in comments and lines[line - 1].lstrip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                text = " ".join(above) or None
            if text:
                docs[f"{node.name}.{field.target.id}"] = text
    return docs


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) and origin is None else str(annotation).replace("typing.", "")


def _one_line(doc: str, limit: int = 100) -> str:
    return doc if len(doc) <= limit else doc[: doc.rfind(" ", 0, limit)] + " ..."


def config_keys(model: type[BaseModel] = schema.TrainConfig, prefix: str = "") -> Iterator[tuple[str, type[BaseModel], str, Any]]:
    """(dotted key, owning section class, field name, annotation) for every leaf of the schema."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from config_keys(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", model, name, annotation


def _groups(config_name: str) -> dict[str, tuple[list[str], str | None]]:
    """{group: (options, this command's default option)} from configs/ and its defaults list."""
    from omegaconf import OmegaConf

    defaults: dict[str, str] = {}
    for entry in OmegaConf.load(config_dir() / f"{config_name}.yaml").get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):  # unresolved: `${data}` picks a hidden group's option
            defaults.update({str(k): str(v) for k, v in OmegaConf.to_container(entry, resolve=False).items()})
    groups = {}
    for folder in sorted(p for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_")):
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if options:
            groups[folder.name] = (options, defaults.get(folder.name))
    return groups


def _lookup(values: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        values = values[part]
    return values


def key_rows(values: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, repr of its value in ``values``, the schema's doc line) for every key,
    in schema order: the rows of ``--help`` and of the docs' configuration reference."""
    docs = schema_docs()
    return [(key, _type_name(ann), repr(_lookup(values, key)), docs.get(f"{owner.__name__}.{name}", ""))
            for key, owner, name, ann in config_keys()]


def command_groups(command: str) -> dict[str, tuple[list[str], str | None]]:
    """{group: (options, ``agentrl <command>``'s default option)}: the folders of ``configs/``."""
    return _groups(command)


def command_help(command: str, overrides: list[str], summary: str) -> str:
    """The help text of ``agentrl <command>``, defaults as composed with ``overrides``."""
    cfg = validate_config(compose(command, overrides), check_files=False, training=command != "rollout")
    values = cfg.model_dump()
    out = [
        f"usage: agentrl {command} [GROUP=OPTION ...] [KEY=VALUE ...] [--cfg job] [--help]",
        "",
        summary,
        "",
        "Overrides are Hydra's; verl's dotted names are accepted too (actor_rollout_ref.actor.clip_ratio=0.28).",
        "--cfg job prints the resolved configuration and exits without running.",
        "",
        "config groups (GROUP=OPTION, * marks this command's default):",
    ]
    groups = _groups(command)
    width = max(map(len, groups), default=0)
    for group, (options, default) in groups.items():
        out.append(f"  {group:<{width}}  " + "  ".join(o + ("*" if o == default else "") for o in options))
    out += ["", "keys (KEY  TYPE  = DEFAULT  doc):"]
    rows = key_rows(values)
    w_key, w_type = max(len(r[0]) for r in rows), min(max(len(r[1]) for r in rows), 28)
    section = None
    for key, type_name, default, doc in rows:
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            out.append(f" {section}")
        out.append(f"  {key:<{w_key}}  {type_name:<{w_type}}  = {default}" + (f"  {_one_line(doc)}" if doc else ""))
    return "\n".join(out)


def plain_yaml(data: Any) -> str:
    """``data`` as YAML with a string quoted only where a YAML reader (PyYAML's, OmegaConf's)
    would read another type. OmegaConf's own dumper also quotes YAML 1.1's one-letter booleans
    (``y``, ``n``), which no reader here takes for booleans: ``rollout.n`` printed as ``'n': 4``."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        try:  # OmegaConf reads more forms as numbers than PyYAML does ("1e-5"): quote what a float parses
            float(value)
        except ValueError:
            return dumper.represent_str(value)
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="'")

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def resolved_config_yaml(command: str, overrides: list[str]) -> str:
    """The validated config of ``agentrl <command> overrides`` as YAML (the values the run saves
    in ``config.yaml``)."""
    import json

    cfg = validate_config(compose(command, overrides), check_files=False, training=command != "rollout")
    return plain_yaml(json.loads(cfg.model_dump_json()))


def config_command_main(command: str, argv: list[str], summary: str) -> int:
    """``agentrl <command> ... --help`` or ``... --cfg job``: print, run nothing."""
    rest = [a for a in argv if a not in ("-h", "--help")]
    if len(rest) != len(argv):
        overrides = [a for a in rest if not a.startswith("--cfg") and a != "job"]
        print(command_help(command, overrides, summary))
        return 0
    index = rest.index("--cfg")
    what = rest[index + 1] if index + 1 < len(rest) else None
    if what != "job":
        print(f"agentrl {command}: --cfg takes 'job' (the resolved configuration), got {what!r}")
        return 2
    print(resolved_config_yaml(command, rest[:index] + rest[index + 2 :]), end="")
    return 0

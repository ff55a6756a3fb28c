"""mkdocs hooks for agentrl's docs site (``hooks:`` in ``mkdocs.yml``).

Two things are done at build time, so that neither can drift from the code:

- The reference pages are generated, not written: ``reference/configuration.md`` from the
  pydantic schema through the rows ``agentrl train --help`` prints (every key, its type, its
  default in the schema and in each command's preset, and the doc line written beside the field
  in ``agentrl/config/schema.py``), and ``reference/cli.md`` from every command's own ``--help``
  (and each subcommand's, found in the command's usage line).
- A page may link a file of the repository outside ``docs/`` (``../examples/plugin_package``,
  ``../SECURITY.md``): the link is checked (a missing file fails the build, like a broken page
  link does in strict mode) and shown as the path in code, since the site has no copy of it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("agentrl_docs")
REPO = Path(__file__).resolve().parents[1]
CONFIG_COMMANDS_SHOWN = ("train", "sft", "rollout")


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def configuration_reference() -> str:
    """The configuration reference page as markdown."""
    from agentrl.config import schema
    from agentrl.config.help import command_groups, key_rows
    from agentrl.config.loader import compose, validate_config

    presets = {c: key_rows(validate_config(compose(c, []), check_files=False).model_dump()) for c in CONFIG_COMMANDS_SHOWN}
    schema_rows = key_rows(schema.TrainConfig().model_dump())
    out = [
        "# Configuration keys",
        "",
        "Generated when the site is built, from what validates a configuration: the keys, types and",
        "doc lines of the pydantic schema (`agentrl/config/schema.py`) and the presets composed from",
        "`configs/` (the same rows `agentrl train --help` prints). How overrides, groups and",
        "validation work: [Configuration](../configuration.md).",
        "",
        "## Config groups",
        "",
        "`GROUP=OPTION` on the command line picks a YAML file of `configs/GROUP/`; **bold** marks",
        "the command's default (a group without one is not in that command's defaults list).",
        "",
        "| group | " + " | ".join(f"`agentrl {c}`" for c in CONFIG_COMMANDS_SHOWN) + " |",
        "| --- |" + " --- |" * len(CONFIG_COMMANDS_SHOWN),
    ]
    groups = {c: command_groups(c) for c in CONFIG_COMMANDS_SHOWN}
    for group, (options, _) in groups["train"].items():
        cells = []
        for command in CONFIG_COMMANDS_SHOWN:
            opts, default = groups[command].get(group, (options, None))
            cells.append(" ".join(f"**{o}**" if o == default else o for o in opts))
        out.append(f"| `{group}` | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Keys",
        "",
        "*schema* is the default in the schema; *train*, *sft* and *rollout* are the values of",
        "`agentrl <command>` with no overrides, where its preset sets another one (blank: the",
        "schema's).",
    ]
    section = None
    for i, (key, type_name, default, doc) in enumerate(schema_rows):
        top = key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"### `{section}`", "", "| key | type | schema | train | sft | rollout | doc |", "| --- | --- | --- | --- | --- | --- | --- |"]
        preset_cells = []
        for command in CONFIG_COMMANDS_SHOWN:
            value = presets[command][i][2]
            assert presets[command][i][0] == key, "key_rows must list the keys in one order"
            preset_cells.append("" if value == default else f"`{_escape(value)}`")
        out.append(
            f"| `{key}` | `{_escape(type_name)}` | `{_escape(default)}` | " + " | ".join(preset_cells) + f" | {_escape(doc)} |"
        )
    return "\n".join(out) + "\n"


def _help_text(argv: list[str]) -> str:
    """What ``agentrl ARGV`` prints, run in this process at a fixed width."""
    from agentrl.cli import main

    buffer = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's --help
                code = exc.code
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    if code not in (0, None):
        raise RuntimeError(f"agentrl {' '.join(argv)} exited {code}: its help cannot be documented")
    return buffer.getvalue().rstrip() + "\n"


def _subcommands(command: str, text: str) -> list[str]:
    """Subcommands named by a help text: ``{show,report}`` / ``{engine|lora}`` in its usage line,
    or lines that start ``agentrl COMMAND NAME``."""
    first = text.splitlines()[0] if text else ""
    names = [n for group in re.findall(r"\{([\w,|-]+)\}", first) for n in re.split(r"[,|]", group)]
    names += re.findall(rf"^\s*agentrl {re.escape(command)} ([a-z][\w-]*)\b", text, flags=re.MULTILINE)
    return list(dict.fromkeys(names))


def cli_reference() -> str:
    """The CLI reference page as markdown: every command's and subcommand's ``--help``."""
    from agentrl.cli import COMMANDS, CONFIG_COMMANDS

    out = [
        "# Command line",
        "",
        "Generated when the site is built from each command's own `--help` (and each subcommand's),",
        "so it says what the installed `agentrl` says. The config commands' keys are in the",
        "[configuration reference](configuration.md).",
        "",
        "| command | what |",
        "| --- | --- |",
    ]
    out += [f"| [`agentrl {name}`](#agentrl-{name}) | {_escape(what)} |" for name, (_, what) in COMMANDS.items()]
    for name in COMMANDS:
        text = _help_text([name, "--help"])
        if name in CONFIG_COMMANDS:  # the keys are the configuration reference's rows
            text = text.split("\nkeys (")[0].rstrip() + "\n\nkeys: see the configuration reference\n"
        out += ["", f"## `agentrl {name}` {{#agentrl-{name}}}", "", "```text", text.rstrip(), "```"]
        for sub in _subcommands(name, text) if name not in CONFIG_COMMANDS else []:
            out += ["", f"### `agentrl {name} {sub}` {{#agentrl-{name}-{sub}}}", "", "```text", _help_text([name, sub, "--help"]).rstrip(), "```"]
    return "\n".join(out) + "\n"


GENERATED = {"reference/configuration.md": configuration_reference, "reference/cli.md": cli_reference}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, make in GENERATED.items():
        if files.get_file_from_path(uri) is not None:
            raise RuntimeError(f"docs/{uri} is generated at build time: remove the written copy")
        files.append(File.generated(config, uri, content=make()))
    return files


REPO_LINK = re.compile(r"\[([^\]]*)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def repo_file(match: re.Match[str]) -> str:
        text, link = match.group(1), match.group(2)
        target = (page_dir / link).resolve()
        if target == docs_dir or docs_dir in target.parents:
            return match.group(0)  # a page of the site: mkdocs checks it
        if not target.exists():  # a warning, which fails a strict build, as a broken page link does
            log.warning(f"Doc file '{page.file.src_uri}' contains a link '{link}', which is not a file of the repository")
            return match.group(0)
        path = target.relative_to(REPO).as_posix()
        return text if path.rstrip("/") in text else f"{text} (`{path}`)"

    return REPO_LINK.sub(repo_file, markdown)

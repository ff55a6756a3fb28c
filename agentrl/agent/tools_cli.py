"""``agentrl tools``: try a tool from the command line.

    agentrl tools call NAME --arguments JSON [--create-kwargs JSON] [--config JSON] [--prefer DIST]
    agentrl tools list

``call`` runs the tool's whole lifecycle once, as the agent layer would for one trajectory:
construct (``--config``), ``create`` (``--create-kwargs``), ``execute`` with the arguments
validated against the tool's JSON schema, ``calc_reward``, and ``release`` (always). It prints
one JSON object ``{"text", "reward", "metrics", "calc_reward"}``; on any failure it prints
``{"error": "..."}`` and exits with 1. ``--prefer`` picks the distribution when several
offer the tool's name (``plugins.prefer.tools.NAME`` in a config).

``list`` prints every installed tool's function schema (name, description, parameters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
from typing import Any

from agentrl.agent.tool import Tool
from agentrl.agent.tools_runtime import validate_arguments
from agentrl.errors import AgentrlError, PluginError, ToolArgumentError, ToolError
from agentrl.plugins import PluginRegistry

__all__ = ["cli_main", "call_tool"]

INSTANCE_ID = "cli"


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolError(f"{flag} is not valid JSON: {exc.msg} at position {exc.pos}: {text!r}") from None
    if not isinstance(value, dict):
        raise ToolError(f"{flag} must be a JSON object, got {type(value).__name__}: {text!r}")
    return value


def load_tool_class(name: str, registry: PluginRegistry | None = None) -> type[Tool]:
    cls = (registry or PluginRegistry()).load("tools", name)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise PluginError(f"tool plugin {name!r} must be a subclass of agentrl.agent.tool.Tool, got {cls!r}")
    return cls


async def call_tool(
    name: str,
    arguments: dict[str, Any],
    *,
    create_kwargs: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    registry: PluginRegistry | None = None,
) -> dict[str, Any]:
    """One trajectory's worth of one tool: construct, create, execute, calc_reward, release."""
    cls = load_tool_class(name, registry)
    problem = validate_arguments(cls, arguments)  # before anything is built, as the agent layer does
    if problem is not None:
        raise ToolArgumentError(problem)
    tool = cls(**(config or {}))
    await tool.create(INSTANCE_ID, **(create_kwargs or {}))
    try:
        result = await tool.execute(INSTANCE_ID, arguments)
        calc_reward = await tool.calc_reward(INSTANCE_ID)
    finally:
        await tool.release(INSTANCE_ID)
    return {"text": result.text, "reward": result.reward, "metrics": result.metrics, "calc_reward": calc_reward}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl tools", description="Try installed tools.")
    sub = parser.add_subparsers(dest="action", required=True)
    call = sub.add_parser("call", help="run one tool once and print JSON")
    call.add_argument("name", help="the tool's entry point name, e.g. calculator")
    call.add_argument("--arguments", required=True, help='the call\'s arguments, a JSON object: \'{"expression": "3*4"}\'')
    call.add_argument("--create-kwargs", default="{}", help="per-trajectory create kwargs, a JSON object")
    call.add_argument("--config", default="{}", help="the tool's constructor kwargs, a JSON object")
    call.add_argument("--prefer", metavar="DIST", help="distribution that wins when several offer NAME")
    sub.add_parser("list", help="list installed tools with their schemas (JSON)")
    return parser


def _list() -> int:
    registry = PluginRegistry()
    rows: list[dict[str, Any]] = []
    for name in registry.names("tools"):
        try:
            rows.append(load_tool_class(name, registry).schema())
        except PluginError as exc:  # a broken or ambiguous tool is shown, not fatal
            rows.append({"name": name, "error": str(exc)})
    print(json.dumps(rows, indent=2))
    return 0


def _call(args: argparse.Namespace) -> int:
    try:
        arguments = _json_object(args.arguments, "--arguments")
        create_kwargs = _json_object(args.create_kwargs, "--create-kwargs")
        config = _json_object(args.config, "--config")
        registry = PluginRegistry({"tools": {args.name: args.prefer}} if args.prefer else None)
        out = asyncio.run(call_tool(args.name, arguments, create_kwargs=create_kwargs, config=config, registry=registry))
    except AgentrlError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    except Exception as exc:  # a bug in the tool: report it like the agent layer does, trace on stderr
        traceback.print_exc(file=sys.stderr)
        print(json.dumps({"error": f"{args.name} failed: {type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(out))
    return 0


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return _list() if args.action == "list" else _call(args)


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

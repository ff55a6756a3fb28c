"""``agentrl tools``: try a tool from the command line.

    agentrl tools call NAME --arguments JSON [--create-kwargs JSON] [--config JSON]
    agentrl tools list

``call`` runs the tool's whole lifecycle once (construct, create, execute with the arguments
validated against its JSON schema, calc_reward, release) and prints one JSON object:
``{"text", "reward", "metrics", "calc_reward"}``, or ``{"error"}`` with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from agentrl.agent.tool import Tool
from agentrl.agent.tools_runtime import validate_arguments
from agentrl.errors import AgentrlError, PluginError, ToolError
from agentrl.plugins import PluginRegistry


def _json_arg(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolError(f"{flag} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise ToolError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


async def call_tool(name: str, arguments: dict[str, Any], create_kwargs: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    cls = PluginRegistry().load("tools", name)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise PluginError(f"tool plugin {name!r} is not a Tool subclass")
    tool = cls(**config)
    problem = validate_arguments(tool, arguments)
    if problem is not None:
        raise ToolError(problem)
    await tool.create("cli", **create_kwargs)
    try:
        result = await tool.execute("cli", arguments)
        calc = await tool.calc_reward("cli")
    finally:
        await tool.release("cli")
    return {"text": result.text, "reward": result.reward, "metrics": result.metrics, "calc_reward": calc}


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl tools")
    sub = parser.add_subparsers(dest="action", required=True)
    call = sub.add_parser("call", help="run one tool once and print JSON")
    call.add_argument("name")
    call.add_argument("--arguments", required=True, help="the call's arguments, a JSON object")
    call.add_argument("--create-kwargs", default="{}", help="per-trajectory create kwargs, a JSON object")
    call.add_argument("--config", default="{}", help="the tool's constructor kwargs, a JSON object")
    sub.add_parser("list", help="list installed tools with their schemas")
    args = parser.parse_args(argv)

    if args.action == "list":
        registry = PluginRegistry()
        rows = []
        for name in registry.names("tools"):
            try:
                rows.append(registry.load("tools", name).schema())
            except PluginError as exc:
                rows.append({"name": name, "error": str(exc)})
        print(json.dumps(rows, indent=2))
        return 0
    try:
        out = asyncio.run(
            call_tool(
                args.name,
                _json_arg(args.arguments, "--arguments"),
                _json_arg(args.create_kwargs, "--create-kwargs"),
                _json_arg(args.config, "--config"),
            )
        )
    except AgentrlError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

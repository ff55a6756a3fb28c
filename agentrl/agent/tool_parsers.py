"""Tool-call parsers (entry point group ``agentrl.tool_parsers``).

A parser turns the text of one assistant turn into its visible content, the tool calls it
made and, for formats that have one, a final answer. A call that cannot be understood is kept
with its error kind - never dropped - so the loop can apply the malformed-call policy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["ParsedCall", "ParsedTurn", "ToolParser", "HermesToolParser", "ReactToolParser"]


@dataclass(slots=True)
class ParsedCall:
    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None  # bad_json (the call's text is not a JSON object with name/arguments)
    detail: str = ""  # what to tell the model when error is set

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI-format tool call, as chat templates render it."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments or {}}}


@dataclass(slots=True)
class ParsedTurn:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    final_answer: str | None = None


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


def _call_from_json(raw: str, body: str) -> ParsedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedCall(raw=raw, error="bad_json", detail=f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
    except RecursionError:  # model output: nesting deeper than the parser's stack
        return ParsedCall(raw=raw, error="bad_json", detail="the tool call is nested too deeply to parse")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(raw=raw, error="bad_json", detail='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return ParsedCall(raw=raw, name=obj["name"], error="bad_json", detail="the arguments string is not valid JSON")
    if not isinstance(arguments, dict):
        return ParsedCall(raw=raw, name=obj["name"], error="bad_json", detail="arguments must be a JSON object")
    return ParsedCall(raw=raw, name=obj["name"], arguments=arguments)


class HermesToolParser:
    """Qwen2.5 / hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per turn."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    OPEN = "<tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls = [_call_from_json(m.group(0), m.group(1).strip()) for m in self._CALL.finditer(text)]
        rest = self._CALL.sub("", text)
        if self.OPEN in rest:  # opened but never closed: a call the model did not finish
            raw = rest[rest.index(self.OPEN) :]
            calls.append(ParsedCall(raw=raw, error="bad_json", detail="the tool call was not closed with </tool_call>"))
            rest = rest[: rest.index(self.OPEN)]
        first = text.find(self.OPEN)
        content = (text[:first] if first >= 0 else text).strip()
        return ParsedTurn(content=content, calls=calls)


class ReactToolParser:
    """Plain-text ReAct: ``Thought: ...`` / ``Action: NAME`` / ``Action Input: ARGS`` or ``Final Answer: ...``.

    ``Action Input`` is a JSON object, or plain text given to the tool's only required
    parameter (the loop maps it, since only the loop knows the tool's schema).
    """

    _ACTION = re.compile(r"^Action:[ \t]*(.*?)[ \t]*\r?\nAction Input:[ \t]*(.*?)[ \t]*$", re.MULTILINE)
    _FINAL = re.compile(r"^Final Answer:[ \t]*(.*)", re.MULTILINE | re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        final = self._FINAL.search(text)
        if final is not None:
            return ParsedTurn(content=text.strip(), final_answer=final.group(1).strip())
        calls = []
        for match in self._ACTION.finditer(text):
            name, raw_input = match.group(1), match.group(2)
            if raw_input.startswith("{"):
                call = _call_from_json(match.group(0), json.dumps({"name": name, "arguments": _loads_or_str(raw_input)}))
            else:
                call = ParsedCall(raw=match.group(0), name=name, arguments={"__input__": raw_input})
            calls.append(call)
        # an Action followed by another line that is not its input (a last Action line may
        # still be waiting for its input line)
        if not calls and re.search(r"^Action:.*\r?\n(?!Action Input:)\S", text, re.MULTILINE):
            calls.append(ParsedCall(raw=text, error="bad_json", detail="an Action must be followed by an 'Action Input:' line"))
        return ParsedTurn(content=text.strip(), calls=calls)


def _loads_or_str(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text

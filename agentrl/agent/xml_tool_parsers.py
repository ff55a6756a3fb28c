"""Tool-call formats whose arguments are XML text: Qwen3-Coder / Qwen3.5 and GLM-4.5 / 4.6
(entry points ``qwen3_coder`` and ``glm45`` in ``agentrl.tool_parsers``).

Qwen3-Coder, Qwen3.5 and Qwen3.6 write
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
GLM-4.5 and 4.6 write ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``.

A value is text. Its type comes from the tool's JSON schema (the session's tool schemas, passed
to ``parse``): a parameter declared ``integer``, ``number``, ``boolean``, ``null``, ``object`` or
``array`` is read as that type (JSON, or the Python spelling Qwen's template writes for booleans
and null: ``True``, ``None``); a parameter declared ``string``, one the schema does not declare,
and every parameter of a tool not in the schemas stay strings. A value that is not of its declared
type makes the call ``invalid_arguments``, with a detail naming the parameter.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from agentrl.agent.tool_parsers import ParsedCall, ParsedTurn

__all__ = ["Qwen3CoderToolParser", "Glm45ToolParser", "typed_arguments"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LITERALS = {"true": True, "false": False, "null": None, "none": None}  # lower-cased text -> value


def _properties(name: str, tools: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The declared properties of tool ``name`` (None: the tool is not in the schemas)."""
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return None


def _declared_types(schema: Any) -> list[str]:
    """The JSON types a property's schema allows (``type``, or its ``anyOf``/``oneOf`` members')."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    members = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for member in members if isinstance(member, dict) for t in _declared_types(member)]


def _as_type(text: str, kind: str) -> tuple[bool, Any]:
    """(True, the value) when ``text`` reads as JSON type ``kind``, else (False, None)."""
    stripped = text.strip()
    if kind in ("boolean", "null"):
        value = _LITERALS.get(stripped.lower(), ...)
        return (value is not ... and (value is None) == (kind == "null")), value
    try:
        value = json.loads(stripped)
    except (json.JSONDecodeError, RecursionError):
        return False, None
    matches = {
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }.get(kind, False)
    return matches, value


def typed_arguments(name: str, params: list[tuple[str, str]], tools: Sequence[dict[str, Any]] | None) -> tuple[dict[str, Any], str | None]:
    """The arguments of a call to ``name`` from its ``(key, text)`` parameters, typed by the
    tool's schema; and what is wrong (None: nothing) when a value is not of its declared type."""
    properties = _properties(name, tools)
    arguments: dict[str, Any] = {}
    for key, text in params:
        kinds = _declared_types((properties or {}).get(key))
        if not kinds or "string" in kinds:
            arguments[key] = text
            continue
        for kind in kinds:
            ok, value = _as_type(text, kind)
            if ok:
                arguments[key] = value
                break
        else:
            shown = text if len(text) <= 60 else text[:57] + "..."
            return arguments, f"invalid arguments for {name}: parameter {key!r} must be {' or '.join(kinds)}, got {shown!r}"
    return arguments, None


def _call(raw: str, name: str, params: list[tuple[str, str]], tools: Sequence[dict[str, Any]] | None) -> ParsedCall:
    keys = [k for k, _ in params]
    repeated = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if repeated is not None:
        return ParsedCall(raw=raw, name=name, error="bad_json", detail=f"parameter {repeated!r} is given twice")
    arguments, problem = typed_arguments(name, params, tools)
    if problem is not None:
        return ParsedCall(raw=raw, name=name, error="invalid_arguments", detail=problem)
    return ParsedCall(raw=raw, name=name, arguments=arguments)


class _TaggedCalls:
    """Calls in ``<tool_call>`` blocks, each read by the format's ``_read``; one left open is
    malformed; the content is the text before the first call."""

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        calls = [self._read(m.group(0), m.group(1), tools) for m in _CALL.finditer(text)]
        rest = _CALL.sub("", text)
        if "<tool_call>" in rest:  # opened but never closed: a call the model did not finish
            calls.append(ParsedCall(raw=rest[rest.index("<tool_call>") :], error="bad_json",
                                    detail="the tool call was not closed with </tool_call>"))
        first = text.find("<tool_call>")
        return ParsedTurn(content=(text[:first] if first >= 0 else text).strip(), calls=calls)

    def _read(self, raw: str, body: str, tools: Sequence[dict[str, Any]] | None) -> ParsedCall:
        raise NotImplementedError


def _only_whitespace_between(body: str, matches: list[re.Match[str]]) -> bool:
    at = 0
    for match in matches:
        if body[at : match.start()].strip():
            return False
        at = match.end()
    return not body[at:].strip()


class Qwen3CoderToolParser(_TaggedCalls):
    """Qwen3-Coder, Qwen3.5, Qwen3.6: ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``,
    several per turn; one newline each side of a value is the format's, not the value's."""

    call_marker = "<function="  # also written outside <tool_call> by a model that drops the wrapper
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The text of ``calls`` as Qwen3-Coder's template renders them (JSON for objects and
        arrays, Python's ``str`` for other values)."""
        def value(v: Any) -> str:
            return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)

        return "\n".join(
            f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in args.items())
            + "</function>\n</tool_call>"
            for name, args in calls
        )

    def _read(self, raw: str, body: str, tools: Sequence[dict[str, Any]] | None) -> ParsedCall:
        function = self._FUNCTION.fullmatch(body)
        if function is None:
            return ParsedCall(raw=raw, error="bad_json", detail="a tool call must be <function=NAME> ... </function> inside <tool_call>")
        name, inner = function.group(1).strip(), function.group(2)
        matches = list(self._PARAMETER.finditer(inner))
        if not _only_whitespace_between(inner, matches):
            return ParsedCall(raw=raw, name=name, error="bad_json", detail="text outside <parameter=KEY> ... </parameter> inside <function>")
        params = [(m.group(1).strip(), _strip_one_newline(m.group(2))) for m in matches]
        return _call(raw, name, params, tools)


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Glm45ToolParser(_TaggedCalls):
    """GLM-4.5, GLM-4.6: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...</tool_call>``,
    several per turn (the template writes a newline after the name and after each tag pair)."""

    call_marker = "<tool_call>"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The text of ``calls`` as GLM's template renders them (JSON for every value but strings)."""
        def value(v: Any) -> str:
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        return "\n".join(
            f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in args.items())
            + "</tool_call>"
            for name, args in calls
        )

    def _read(self, raw: str, body: str, tools: Sequence[dict[str, Any]] | None) -> ParsedCall:
        at = body.find("<arg_key>")
        name = (body if at < 0 else body[:at]).strip()
        if not name or any(c.isspace() for c in name) or "<" in name:
            return ParsedCall(raw=raw, error="bad_json", detail="a tool call must start with the function's name: <tool_call>NAME<arg_key>...")
        inner = "" if at < 0 else body[at:]
        matches = list(self._PAIR.finditer(inner))
        if not _only_whitespace_between(inner, matches):
            return ParsedCall(raw=raw, name=name, error="bad_json", detail="each <arg_key>KEY</arg_key> must be followed by <arg_value>VALUE</arg_value>")
        return _call(raw, name, [(m.group(1).strip(), m.group(2)) for m in matches], tools)

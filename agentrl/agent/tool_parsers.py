"""Tool-call parsers (entry point group ``agentrl.tool_parsers``).

A parser turns the text of one assistant turn into its visible content, the tool calls it
made and, for formats that have one, a final answer. A call that cannot be understood is kept
with its error kind - never dropped - so the loop can apply the malformed-call policy.
"""

from __future__ import annotations

import inspect
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

__all__ = [
    "ParsedCall", "ParsedTurn", "ToolParser", "HermesToolParser", "ReactToolParser", "MistralToolParser",
    "Llama3JsonToolParser", "Phi4MiniToolParser", "DeepSeekR1ToolParser", "mistral_call_id", "parse_turn",
]


@dataclass(slots=True)
class ParsedCall:
    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    # bad_json (the call's text cannot be read in the family's format: JSON, or XML tags), or
    # invalid_arguments (a typed parameter's text does not match the tool's schema)
    error: str | None = None
    detail: str = ""  # what to tell the model when error is set
    id: str | None = None  # the call id, for families whose templates pair calls and results by id (Mistral)

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI-format tool call, as chat templates render it."""
        call: dict[str, Any] = {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments or {}}}
        if self.id is not None:
            call["id"] = self.id
        return call

    def result_message(self, text: str) -> dict[str, Any]:
        """The ``tool`` message that answers this call (with ``tool_call_id`` when the call has an id)."""
        message: dict[str, Any] = {"role": "tool", "content": text}
        if self.id is not None:
            message["tool_call_id"] = self.id
        return message


@dataclass(slots=True)
class ParsedTurn:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    final_answer: str | None = None


class ToolParser(Protocol):
    """Reads one assistant turn. ``tools`` are the session's tool schemas (OpenAI format): formats
    whose arguments are text (XML parameters) type them by it, JSON formats ignore it. A parser
    written for ``parse(text)`` alone still works (``parse_turn`` calls it without the schemas).
    ``call_marker`` (a class attribute) is the text that opens a call in the format: a turn that
    holds it but yields no call counts as an unparsed attempt (metric ``tool_calls/unparsed_turns``)."""

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn: ...


_TAKES_TOOLS: dict[type, bool] = {}


def parse_turn(parser: Any, text: str, tools: Sequence[dict[str, Any]] | None) -> ParsedTurn:
    """``parser.parse(text, tools)``, or ``parser.parse(text)`` for a parser that takes no schemas."""
    cls = type(parser)
    takes = _TAKES_TOOLS.get(cls)
    if takes is None:
        params = inspect.signature(parser.parse).parameters
        takes = _TAKES_TOOLS[cls] = "tools" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    result: ParsedTurn = parser.parse(text, tools=tools) if takes else parser.parse(text)
    return result


def _call_from_json(raw: str, body: str) -> ParsedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedCall(raw=raw, error="bad_json", detail=f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
    except RecursionError:  # model output: nesting deeper than the parser's stack
        return ParsedCall(raw=raw, error="bad_json", detail="the tool call is nested too deeply to parse")
    return _call_from_obj(raw, obj)


def _call_from_obj(raw: str, obj: Any, arguments_key: str = "arguments") -> ParsedCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(raw=raw, error="bad_json", detail=f'a tool call must be a JSON object {{"name": ..., "{arguments_key}": {{...}}}}')
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return ParsedCall(raw=raw, name=obj["name"], error="bad_json", detail="the arguments string is not valid JSON")
    if not isinstance(arguments, dict):
        return ParsedCall(raw=raw, name=obj["name"], error="bad_json", detail="arguments must be a JSON object")
    return ParsedCall(raw=raw, name=obj["name"], arguments=arguments)


class HermesToolParser:
    """Qwen2.5 / Qwen3 / hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per turn."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    OPEN = call_marker = "<tool_call>"

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The text a model of this format writes for ``calls`` (as Qwen's templates render them)."""
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}\n</tool_call>' for n, a in calls)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
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
    call_marker = "Action:"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
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


# ---------------------------------------------------------------------- native formats of other families
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id() -> str:
    """A tool-call id in Mistral's format: exactly nine alphanumeric characters (its template refuses others)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _is_mistral_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 9 and value.isascii() and value.isalnum()


def _json_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of ``text`` and where it ends (raises JSONDecodeError)."""
    return json.JSONDecoder().raw_decode(text)


def _calls_from_json_list(raw: str, body: str, arguments_key: str = "arguments") -> list[ParsedCall]:
    try:
        obj, _ = _json_prefix(body.strip())
    except json.JSONDecodeError as exc:
        return [ParsedCall(raw=raw, error="bad_json", detail=f"the tool calls are not valid JSON ({exc.msg} at position {exc.pos})")]
    except RecursionError:  # model output: nesting deeper than the parser's stack
        return [ParsedCall(raw=raw, error="bad_json", detail="the tool calls are nested too deeply to parse")]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return [ParsedCall(raw=raw, error="bad_json", detail="the list of tool calls is empty")]
    return [_call_from_obj(raw if len(items) == 1 else json.dumps(item, ensure_ascii=False), item, arguments_key) for item in items]


class MistralToolParser:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; the text before it is the content.

    Mistral's chat templates pair each tool result with its call by an id of exactly nine
    alphanumeric characters: a call the model wrote without a valid id gets a fresh one here, and
    the id goes into the assistant message's ``tool_calls`` and the ``tool`` message's
    ``tool_call_id`` (both kept in ``Trajectory.messages``)."""

    OPEN = call_marker = "[TOOL_CALLS]"

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        at = text.find(self.OPEN)
        if at < 0:
            return ParsedTurn(content=text.strip())
        raw = text[at:]
        calls = _calls_from_json_list(raw, raw[len(self.OPEN) :])
        for call, item_id in zip(calls, _ids_in(raw[len(self.OPEN) :])):
            call.id = item_id if _is_mistral_id(item_id) else mistral_call_id()
        for call in calls:
            if call.id is None:
                call.id = mistral_call_id()
        return ParsedTurn(content=text[:at].strip(), calls=calls)


def _ids_in(body: str) -> list[Any]:
    try:
        obj, _ = _json_prefix(body.strip())
    except json.JSONDecodeError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    return [item.get("id") if isinstance(item, dict) else None for item in items]


class Llama3JsonToolParser:
    """Llama 3.1 / 3.2 / 3.3: the turn is one JSON object ``{"name": ..., "parameters": {...}}``
    (as their templates render a call), optionally after ``<|python_tag|>``.

    A turn that starts with ``{`` and names a tool but is not valid JSON is a malformed call; any
    other text is an answer. ``<|python_tag|>`` followed by code (Llama's built-in code
    interpreter) is not a JSON call: it is reported malformed rather than taken as an answer."""

    TAG = "<|python_tag|>"
    call_marker = '{"name"'  # a JSON call written after other text is not read as one

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        if tagged:
            body = body[len(self.TAG) :].strip()
        elif not (body.startswith("{") and '"name"' in body):
            return ParsedTurn(content=body)
        calls: list[ParsedCall] = []
        rest = body
        while rest:
            try:
                obj, end = _json_prefix(rest)
            except json.JSONDecodeError as exc:
                detail = f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})"
                if tagged and not rest.startswith("{"):
                    detail = "<|python_tag|> must be followed by a JSON tool call; code calls are not supported"
                calls.append(ParsedCall(raw=rest, error="bad_json", detail=detail))
                break
            calls.append(_call_from_obj(rest[:end], obj, "parameters"))
            rest = rest[end:].lstrip().lstrip(";").lstrip()
        return ParsedTurn(content="", calls=calls)


class Phi4MiniToolParser:
    """Phi-4-mini: ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``."""

    _CALL = re.compile(r"<\|tool_call\|>(.*?)(<\|/tool_call\|>|$)", re.DOTALL)
    OPEN = call_marker = "<|tool_call|>"

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False) + "<|/tool_call|>"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        calls: list[ParsedCall] = []
        for match in self._CALL.finditer(text):
            if not match.group(2):
                calls.append(ParsedCall(raw=match.group(0), error="bad_json", detail="the tool call was not closed with <|/tool_call|>"))
            else:
                calls.extend(_calls_from_json_list(match.group(0), match.group(1)))
        first = text.find(self.OPEN)
        return ParsedTurn(content=(text[:first] if first >= 0 else text).strip(), calls=calls)


class DeepSeekR1ToolParser:
    """DeepSeek-R1 (and its distills): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``, as its template renders a call."""

    OPEN = call_marker = "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.DOTALL)

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        body = "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```<｜tool▁call▁end｜>"
            for n, a in calls
        )
        return "<｜tool▁calls▁begin｜>" + body + "<｜tool▁calls▁end｜>"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        at = text.find(self.OPEN)
        if at < 0:
            return ParsedTurn(content=text.strip())
        block = text[at:]
        calls = [
            _call_from_json(m.group(0), json.dumps({"name": m.group(2).strip(), "arguments": _loads_or_str(m.group(3))}))
            if _is_json_object(m.group(3)) else
            ParsedCall(raw=m.group(0), name=m.group(2).strip(), error="bad_json", detail="the arguments are not a JSON object")
            for m in self._CALL.finditer(block)
        ]
        if not calls or "<｜tool▁calls▁end｜>" not in block:
            calls.append(ParsedCall(raw=block, error="bad_json", detail="a tool-call block must hold complete calls and end with <｜tool▁calls▁end｜>"))
        return ParsedTurn(content=text[:at].strip(), calls=calls)


def _is_json_object(text: str) -> bool:
    return isinstance(_loads_or_str(text), dict)

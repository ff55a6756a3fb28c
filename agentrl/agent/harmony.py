"""gpt-oss: OpenAI's harmony format, its tool-call parser and the renderer's harmony path.

After the generation prompt ``<|start|>assistant`` a gpt-oss turn is one or more messages, each
``HEADER<|message|>BODY``, the next one opened by ``<|start|>assistant``:

* ``<|channel|>analysis<|message|>...<|end|>``: reasoning; the model goes on with the next message;
* a tool call: the recipient ``to=functions.NAME`` in the role header (``assistant
  to=functions.NAME<|channel|>commentary json``, as the chat template renders calls) or in the
  channel header (``<|channel|>commentary to=functions.NAME <|constrain|>json``, as the model often
  writes them), the JSON arguments as the body, ended by ``<|call|>``;
* ``<|channel|>final<|message|>...`` ended by ``<|return|>``: the answer.

Generation stops at ``<|call|>`` and ``<|return|>`` only (``<|end|>`` closes an analysis message
and the model goes on), so a turn makes at most one call. A tool result comes back as the
template renders it: ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"..."<|end|>``
(the result JSON-quoted, NAME the call's), then the next generation prompt.

The chat template rewrites the history once the conversation goes on: a final answer sampled
with ``<|return|>`` is rendered with ``<|end|>``, the analysis of every turn before a final answer
is dropped, and a call is rendered in the template's own header (role-header recipient, ``commentary
json``, arguments as ``tojson`` writes them). The stream keeps what was sampled; every observation
delta is exactly the template's rendering of the new messages, and ``agent.history=as_template``
starts a new segment wherever a fresh rendering differs (``agentrl.agent.history``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from agentrl.agent.render import ChatRenderer, TemplateUnsupported, second_round_problem
from agentrl.agent.tool_parsers import ParsedCall, ParsedTurn

__all__ = ["HarmonyToolParser", "HarmonyCall", "HarmonyRenderer", "is_harmony_template", "name_tool_results", "HISTORY_NOTE"]

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
_ROLE_END = re.compile(r"\s|<")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]*)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w*)")
_JSON_TYPE = re.compile(r"(?:" + re.escape(CONSTRAIN) + r"|\s)json\s*$")
# what check-template says of the history (docs/model_families.md, gpt-oss)
HISTORY_NOTE = (
    "gpt-oss: a final answer the model ended with <|return|> is rendered with <|end|> once the conversation goes on, "
    "the analysis of every turn before a final answer is dropped, and a call is rendered in the template's own header "
    "(to=functions.NAME<|channel|>commentary json, the arguments as tojson writes them); the stream keeps every turn "
    "as sampled and each observation as the template renders it"
)
_QUESTION = "\x00question\x00"  # the dummy conversation the deltas are anchored on
_ANSWER = "\x00answer\x00"


def is_harmony_template(template: str) -> bool:
    """Whether a chat template writes OpenAI's harmony format (gpt-oss)."""
    return all(token in template for token in (START + "assistant", CHANNEL, MESSAGE, CALL))


@dataclass(slots=True)
class HarmonyCall(ParsedCall):
    """A harmony call: its result message carries the call's ``name``, which the template writes
    into the result's header (``functions.NAME to=assistant``) and a delta is rendered from."""

    def result_message(self, text: str) -> dict[str, Any]:
        return {"role": "tool", "content": text, "name": self.name or ""}


@dataclass(frozen=True, slots=True)
class _Message:
    header: str  # the role header and channel header, the role first
    body: str | None  # None: the message never reached ``<|message|>``
    recipient: str | None  # of an assistant message only (a tool's message is addressed to=assistant)
    channel: str

    @property
    def raw(self) -> str:
        return START + self.header + ("" if self.body is None else MESSAGE + self.body)


def _messages(text: str) -> list[_Message]:
    out = []
    for part in ("assistant" + text).split(START):
        header, has_body, body = part.partition(MESSAGE)
        recipient = _RECIPIENT.search(header) if _ROLE_END.split(header, maxsplit=1)[0] == "assistant" else None
        channel = _CHANNEL.search(header)
        out.append(_Message(header, body.removesuffix(END) if has_body else None,
                            recipient.group(1) if recipient else None, channel.group(1) if channel else ""))
    return out


class HarmonyToolParser:
    """gpt-oss (harmony): a call is a message to ``functions.NAME`` (recipient in the role or the
    channel header, with or without ``<|constrain|>json``) whose body is the JSON arguments.

    The content of a turn that calls a tool is its analysis (the template renders an assistant
    message's content before its call as the analysis message); of a turn that answers, the final
    channel's text (also ``final_answer``). A call with bad JSON, without a function name, to a
    built-in tool (``browser``, ``python``), or after a first call in the same turn is kept with
    its error (``bad_json``)."""

    call_marker = "to=functions."

    @staticmethod
    def format_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The text of a call as the template renders it (the turn then ends with ``<|call|>``)."""
        if len(calls) != 1:
            raise ValueError(f"a gpt-oss turn makes one tool call (it ends at <|call|>), not {len(calls)}")
        [(name, arguments)] = calls
        return f" to=functions.{name}{CHANNEL}commentary json{MESSAGE}{json.dumps(arguments, ensure_ascii=False)}"

    @staticmethod
    def format_answer(text: str) -> str:
        """A final answer's text (the turn then ends with ``<|return|>``)."""
        return f"{CHANNEL}final{MESSAGE}{text}"

    @staticmethod
    def format_analysis(text: str) -> str:
        """An analysis message and the header of the message after it."""
        return f"{CHANNEL}analysis{MESSAGE}{text}{END}{START}assistant"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        if MESSAGE not in text and CHANNEL not in text:  # no harmony header at all: plain text
            return ParsedTurn(content=text)
        messages = _messages(text)
        calls: list[ParsedCall] = []
        final: str | None = None
        notes: list[str] = []  # analysis and commentary without a recipient
        for m in messages:
            call_like = m.recipient is not None or (m.channel == "commentary" and bool(_JSON_TYPE.search(m.header)))
            if call_like:
                call = self._call(m)
                if calls and call.error is None:
                    call = HarmonyCall(raw=m.raw, name=call.name, error="bad_json",
                                       detail="a gpt-oss turn makes one tool call: it ends with <|call|>")
                calls.append(call)
            elif m.body is not None and m.channel == "final":
                final = m.body
            elif m.body is not None:
                notes.append(m.body)
        if calls:
            return ParsedTurn(content="\n\n".join(notes), calls=calls)
        if final is not None:
            return ParsedTurn(content=final, final_answer=final)
        return ParsedTurn(content="\n\n".join(notes))

    @staticmethod
    def _call(m: _Message) -> HarmonyCall:
        recipient = m.recipient or ""
        if not recipient.startswith("functions.") or recipient == "functions.":
            if recipient and not recipient.startswith("functions"):
                detail = f"the recipient {recipient!r} is a built-in tool; call a function as to=functions.NAME"
            else:
                detail = "the tool call names no function: write the recipient as to=functions.NAME"
            return HarmonyCall(raw=m.raw, error="bad_json", detail=detail)
        name = recipient.removeprefix("functions.")
        if m.body is None:
            return HarmonyCall(raw=m.raw, name=name, error="bad_json", detail="the tool call has no <|message|> with its arguments")
        try:
            arguments = json.loads(m.body)
        except json.JSONDecodeError as exc:
            return HarmonyCall(raw=m.raw, name=name, error="bad_json",
                               detail=f"the arguments of functions.{name} are not valid JSON ({exc.msg} at position {exc.pos})")
        except RecursionError:  # model output: nesting deeper than the parser's stack
            return HarmonyCall(raw=m.raw, name=name, error="bad_json", detail="the tool call is nested too deeply to parse")
        if not isinstance(arguments, dict):
            return HarmonyCall(raw=m.raw, name=name, error="bad_json", detail="arguments must be a JSON object")
        return HarmonyCall(raw=m.raw, name=name, arguments=arguments)


def _call_turn(name: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}


class HarmonyRenderer(ChatRenderer):
    """``ChatRenderer`` for harmony templates (``agentrl.agent.families.family_renderer`` picks it).

    A turn ends with ``<|return|>`` (an answer: ``eos_token``) or ``<|call|>`` (a call:
    ``call_token``). A delta is rendered after the dummy turn the new messages follow: tool results
    after a call to the function they name (a tool message needs ``name``: ``HarmonyCall``),
    anything else after a final answer, which the template ends with ``<|end|>`` in history."""

    message_end_tokens = (CALL, END)

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None):
        super().__init__(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs)
        if self.eos_token != RETURN:
            raise ValueError(f"a harmony template ends an answer with {RETURN!r}, this one with {self.eos_token!r}")
        self.call_token = CALL
        self.call_id = tokenizer.convert_tokens_to_ids(CALL)

    def _delta(self, messages: Sequence[dict[str, Any]]) -> str:
        question = {"role": "user", "content": _QUESTION}
        if messages and messages[0]["role"] == "tool":
            name = messages[0].get("name")
            if name is None:
                raise TemplateUnsupported(
                    "gpt-oss's chat template writes a tool result under the name of the call it answers "
                    "(<|start|>functions.NAME to=assistant): the tool message needs 'name'")
            full = self._render([question, _call_turn(name), *messages], add_generation_prompt=True)
            return full[full.index(CALL, full.index(_QUESTION)) + len(CALL) :]
        full = self._render([question, {"role": "assistant", "content": _ANSWER}, *messages], add_generation_prompt=True)
        rest = full[full.index(_ANSWER) + len(_ANSWER) :]
        if not rest.startswith(END):
            raise ValueError(f"the chat template ends a final answer followed by {[m['role'] for m in messages]} with "
                             f"{rest[:40]!r}, not with {END!r}")
        return rest[len(END) :]

    def _probe_tool_messages(self) -> str | None:
        # a delta is rendered without the earlier turns: a second round of results (after a call
        # to another function) must render as it does after the first round
        question = {"role": "user", "content": _QUESTION}
        first = {"role": "tool", "content": "tool-result-probe-7f3a", "name": "probe"}
        second = {"role": "tool", "content": "tool-result-probe-2", "name": "probe_two"}
        try:
            alone = self._delta([second])
            full = self._render([question, _call_turn("probe"), first, _call_turn("probe_two"), second], add_generation_prompt=True)
        except Exception as exc:
            return f"rendering a tool message raised {type(exc).__name__}: {exc}"
        return second_round_problem(alone, full, CALL, second["content"])


def name_tool_results(renderer: ChatRenderer, before: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` to render after ``before``: for a harmony renderer, each tool message without
    a ``name`` (an OpenAI client's) named as the template names it, after the first call of the
    last assistant message that made calls; any other renderer's messages unchanged."""
    if not isinstance(renderer, HarmonyRenderer):
        return list(messages)
    calls = next((m["tool_calls"] for m in reversed(before) if m.get("role") == "assistant" and m.get("tool_calls")), None)
    if not calls:
        return list(messages)
    name = (calls[0].get("function") or calls[0]).get("name") or ""
    return [dict(m, name=name) if m.get("role") == "tool" and "name" not in m else m for m in messages]

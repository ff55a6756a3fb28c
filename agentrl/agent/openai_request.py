"""A chat-completions request as the OpenAI endpoint reads it (``agentrl.agent.openai_endpoint``):
its fields checked and refused naming the field (``read_request``), its messages and tools as the
chat template renders them (``messages_and_tools``), the sampling fields the trainer owns said
once when a request asks otherwise (``log_overrides``); and the text an answer sends back
(``answer_text``)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.agent.openai_wire import RequestRefused, normalize_message
from agentrl.engines.base import SamplingParams

if TYPE_CHECKING:
    from agentrl.agent.loop import SampledTurn
    from agentrl.agent.render import ChatRenderer

__all__ = ["Ask", "read_request", "messages_and_tools", "log_overrides", "logged_overrides", "answer_text"]

log = logging.getLogger("agentrl.agent.openai_endpoint")  # what the endpoint says, under its name

# What the endpoint does with each request field (docs/own-agent.md lists them all): the
# sampling parameters the trainer owns are the run's whatever a request asks (the sampled policy
# must be the rollout's; a request asking otherwise is logged once per parameter and process);
# these are the neutral values of the ones the rollout never applies.
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "logit_bias": {}, "response_format": {"type": "text"}}
# n > 1, top_logprobs and a forced tool_choice are refused with a 400 naming the field (no answer
# would be what was asked); every other field, known or not, is ignored as OpenAI-compatible
# servers ignore what they do not know.


@dataclass(frozen=True, slots=True)
class Ask:
    """A chat-completions request as the endpoint serves it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_calls: bool  # tool_choice is not 'none'
    stop: tuple[str, ...]
    include_stop: bool  # vLLM's include_stop_str_in_output: keep the stop string in the content
    max_tokens: int | None
    logprobs: bool = False  # the sampled tokens' logprobs in choices[0].logprobs.content
    token_ids: bool = False  # vLLM's return_token_ids: prompt_token_ids and choices[0].token_ids
    tokens: list[int] | None = None  # /chat/completions/tokens: the prompt ids to generate from


logged_overrides: set[str] = set()
_lock = threading.Lock()


def log_overrides(body: dict[str, Any], sampling: SamplingParams, seeded: bool) -> None:
    """One line per trainer-owned parameter a request asked to set otherwise, the first time in
    this process: the parameter, what was asked and the value used."""
    used: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                            "seed": "the run's, per call" if seeded else None, **_NEUTRAL}
    for key, value in used.items():
        asked = body.get(key)
        if asked is None or asked == value or key in logged_overrides:
            continue
        with _lock:
            if key in logged_overrides:
                continue
            logged_overrides.add(key)
        shown = "none" if value is None else f"{value!r}" + (" (not applied)" if key in _NEUTRAL else "")
        log.warning("OpenAI endpoint: a request asked %s=%r; the rollout's is used instead: %s=%s "
                    "(said once per process)", key, asked, key, shown)


def as_rendered(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the chat template is given it: without OpenAI's ``strict`` flag, which asks the
    server to constrain generation to the schema (this endpoint does not) and describes nothing
    to the model. Frameworks set it by default (the Agents SDK sends ``strict`` on every function
    tool); rendered, it would be text the model never saw beside its tools."""
    function = tool.get("function")
    if isinstance(function, dict) and "strict" in function:
        return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
    return tool


def messages_and_tools(body: dict[str, Any], missing: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A request's ``messages``, normalised, and its ``tools`` as rendered (None: none); refused
    naming the field (``missing``: what is said when there are no messages)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestRefused(missing, param="messages")
    messages = [normalize_message(m, where=f"messages[{i}]") for i, m in enumerate(raw)]
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestRefused("tools: a list of tool objects is required", param="tools")
    return messages, None if tools is None else [as_rendered(t) for t in tools]


def read_request(body: dict[str, Any], *, vocab: int, max_new_tokens: int, with_tokens: bool = False) -> Ask:
    """A request body as the endpoint serves it (``with_tokens``: the ``/chat/completions/tokens``
    route, whose ``tokens`` must be ids below ``vocab``), or ``RequestRefused`` naming the field.
    A ``max_tokens`` above ``max_new_tokens`` (``rollout.max_new_tokens``) is said once per process."""
    if body.get("top_logprobs"):  # accepted when off: only the sampled tokens' own logprobs exist here
        raise RequestRefused(f"top_logprobs={body['top_logprobs']!r}: not supported (only the sampled tokens' "
                             "logprobs are computed: ask logprobs=true and leave top_logprobs unset)", param="top_logprobs")
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False):
        raise RequestRefused(f"logprobs={logprobs!r}: true or false is required", param="logprobs")
    tokens = body.get("tokens") if with_tokens else None
    if with_tokens:
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
            raise RequestRefused(f"tokens: a non-empty list of token ids below the vocabulary size {vocab} is required",
                                 param="tokens")
    n = body.get("n")
    if n not in (None, 1):
        raise RequestRefused(f"n={n!r}: only n=1 is supported (one trajectory samples one answer per call)", param="n")
    messages, tools = messages_and_tools(body, "messages: a non-empty list is required")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestRefused(f"tool_choice={choice!r}: only 'auto' and 'none' are supported "
                             "(generation is not constrained)", param="tool_choice")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise RequestRefused(f"stop={stop!r}: a string or a list of strings is required", param="stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestRefused(f"max_tokens={max_tokens!r}: a positive integer is required", param="max_tokens")
    if max_tokens is not None and max_tokens > max_new_tokens and "max_tokens" not in logged_overrides:
        with _lock:
            first = "max_tokens" not in logged_overrides
            logged_overrides.add("max_tokens")
        if first:
            log.warning("OpenAI endpoint: a request asked max_tokens=%d; at most rollout.max_new_tokens=%d are "
                        "sampled (said once per process)", max_tokens, max_new_tokens)
    return Ask(messages, tools, choice != "none", tuple(s for s in stops if s),
                bool(body.get("include_stop_str_in_output")), max_tokens, bool(logprobs),
                bool(body.get("return_token_ids")), tokens)



def answer_text(sampled: SampledTurn, renderer: ChatRenderer, turn_ends: tuple[int, ...]) -> tuple[str, bool]:
    """The text an answer sends back, and whether the turn ended on one of ``turn_ends`` (the
    family's end-of-turn ids). An engine that checks the length limit before the stop ids
    (SGLang, agentrl's builtin engine) reports a turn whose last allowed token is the end-of-turn
    id as ``length``; the model still ended its turn there. As vLLM and SGLang answer, that id is
    never in the content (a client echoes the content back, and a re-run, whose engine reports
    ``stop``, must read the same text), and the observation after it starts with the template's
    separator, as after any other ended turn."""
    ids = sampled.result.output_ids
    if sampled.stopped_on_eos or not ids or ids[-1] not in turn_ends:
        return sampled.text, sampled.stopped_on_eos
    return renderer.decode(ids[:-1]), True

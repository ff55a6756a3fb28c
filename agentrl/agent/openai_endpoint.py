"""An OpenAI-compatible chat-completions endpoint in front of the rollout engine.

An agent program written against the ``openai`` client (or any framework that speaks the chat
completions API) gets a ``base_url`` and ``api_key`` for one trajectory (``EndpointSession``).
Each request is rendered with the policy's chat template (``ChatRenderer``, the path agentrl's
own loops use), generated token in / token out by the engine, and answered with the text and the
``tool_calls`` the family's parser reads from it. Every call's prompt ids, sampled ids and
logprobs are kept, and the calls are assembled into exact token streams:

* a request whose messages are the session's context so far (the earlier messages and the
  assistant message this endpoint answered, as the client echoes it) followed by tool or user
  messages *extends* the context: the new messages are rendered as an observation delta (masked)
  after the sampled tokens, which are never re-tokenized;
* any other request (the program dropped, rewrote or summarised its history, or changed its
  tools) starts a new *segment* from a fresh rendering; ``segment_splits`` counts them.

A client that keeps token ids itself (verifiers' token client, prime-rl's) gets what vLLM gives
it: ``logprobs: true`` returns each sampled token's logprob (the engine's, as the trainer checks
them; ``top_logprobs`` is refused: no other token's logprob is computed), ``return_token_ids: true``
returns the request's ``prompt_token_ids`` and the answer's ``token_ids``, ``/tokenize`` renders
messages through the chat template, and ``/v1/chat/completions/tokens`` generates from the
prompt ids the client sends (``tokens``): when the segment's ids so far are a prefix of them,
the rest is appended as the observation (masked), exactly as sent; otherwise they start a segment.

It answers as vLLM and SGLang do: a call that cannot be understood (bad JSON, a tool the request
did not offer, arguments its schema refuses) comes back as the answer's text with no
``tool_calls`` and is recorded with its kind for ``agent.malformed_call_policy``; ``stop``
strings of any length end generation at the token completing one (``SamplingParams.stop``) and
are cut from the content. The sampling the trainer owns is the rollout's whatever a request asks
(said once per parameter); fields it does not know are ignored. docs/own-agent.md lists every
field.

The server (``OpenAIEndpoint``) runs uvicorn in a thread of its own, bound to 127.0.0.1, with a
random key per process; a session is a random path under it, so concurrent agents never mix.
Generation runs on the event loop that owns the engine (the rollout's), reached with
``run_coroutine_threadsafe``, and every wait is bounded by the trajectory timeout.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentrl.agent.loop import EpisodeEnd, LoopContext, sample_turn
from agentrl.agent.openai_wire import MODEL_NAME, RequestRefused, error_response, normalize_message, sse_stream
from agentrl.agent.setup import Limits
from agentrl.agent.render import ChatRenderer
from agentrl.agent.tool_parsers import ParsedCall, ToolParser
from agentrl.agent.tools_runtime import schema_problem
from agentrl.engines.base import Engine, FinishReason, SamplingParams
from agentrl.data.row import Row
from agentrl.engines.stops import cut_at_stop
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectoryBuilder, TrajectoryFinish, TrajectorySegment, Turn, TurnRole

__all__ = ["OpenAIEndpoint", "EndpointSession", "Segment", "CallRecord", "RequestRefused", "endpoint"]

log = logging.getLogger(__name__)

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
class _Ask:
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


_logged_overrides: set[str] = set()
_logged_lock = threading.Lock()


def _log_overrides(body: dict[str, Any], sampling: SamplingParams, seeded: bool) -> None:
    """One line per trainer-owned parameter a request asked to set otherwise, the first time in
    this process: the parameter, what was asked and the value used."""
    used: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                            "seed": "the run's, per call" if seeded else None, **_NEUTRAL}
    for key, value in used.items():
        asked = body.get(key)
        if asked is None or asked == value or key in _logged_overrides:
            continue
        with _logged_lock:
            if key in _logged_overrides:
                continue
            _logged_overrides.add(key)
        shown = "none" if value is None else f"{value!r}" + (" (not applied)" if key in _NEUTRAL else "")
        log.warning("OpenAI endpoint: a request asked %s=%r; the rollout's is used instead: %s=%s "
                    "(said once per process)", key, asked, key, shown)


def _as_rendered(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the chat template is given it: without OpenAI's ``strict`` flag, which asks the
    server to constrain generation to the schema (this endpoint does not) and describes nothing
    to the model. Frameworks set it by default (the Agents SDK sends ``strict`` on every function
    tool); rendered, it would be text the model never saw beside its tools."""
    function = tool.get("function")
    if isinstance(function, dict) and "strict" in function:
        return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
    return tool


def _messages_and_tools(body: dict[str, Any], missing: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A request's ``messages``, normalised, and its ``tools`` as rendered (None: none); refused
    naming the field (``missing``: what is said when there are no messages)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestRefused(missing, param="messages")
    messages = [normalize_message(m, where=f"messages[{i}]") for i, m in enumerate(raw)]
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestRefused("tools: a list of tool objects is required", param="tools")
    return messages, None if tools is None else [_as_rendered(t) for t in tools]


@dataclass(slots=True)
class CallRecord:
    """One chat-completions call as the engine saw it."""

    segment: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the engine's: stop | length | abort
    merged: bool  # True: the prompt extended the segment's context


@dataclass(slots=True)
class Segment:
    """One exact token stream: a prompt, then sampled (mask 1) and observed (mask 0) tokens."""

    builder: TrajectoryBuilder
    messages: list[dict[str, Any]]  # the context as normalised messages, ending with the last answer
    tools: list[dict[str, Any]] | None
    stopped_on_eos: bool = False


@dataclass(slots=True)
class EndpointSession:
    """One trajectory's view of the endpoint: its calls, segments and counters."""

    engine: Engine
    renderer: ChatRenderer
    parser: ToolParser
    limits: Limits
    sampling: SamplingParams
    session_id: str
    seed: int | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the loop the engine runs on (set by open_session)
    calls: list[CallRecord] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    assistant_turns: int = 0
    tool_calls_returned: int = 0  # calls parsed from the answers (what the policy asked to run)
    finish: TrajectoryFinish | None = None  # set when a limit or the engine ended the trajectory
    error: str | None = None
    malformed_calls: list[tuple[int, ToolCallRecord]] = field(default_factory=list)  # (segment, call) answered as text
    tool_errors: Counter[str] = field(default_factory=Counter)  # malformed calls by kind
    refused: str | None = None  # the first request refused with a 4xx that did not end the trajectory
    crashed: str | None = None  # the endpoint's own failure serving a request (answered 500)
    weight_versions: list[int] = field(default_factory=list)
    gen_time: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def for_trajectory(cls, ctx: LoopContext, loop_name: str, *, row_id: str, sample_index: int,
                       seed: int | None) -> EndpointSession:
        """The session of one trajectory of the loop ``loop_name`` (its tool parser), on the rollout's engine."""
        return cls(engine=ctx.engine, renderer=ctx.renderer, parser=ctx.parser_for(loop_name), limits=ctx.limits,
                   sampling=ctx.sampling, session_id=f"{row_id}#{sample_index}", seed=seed)

    @property
    def segment_splits(self) -> int:
        return max(0, len(self.segments) - 1)

    def trajectory(self, row: Row, ctx: LoopContext, *, agent_name: str, row_id: str, group_id: str, sample_index: int,
                   finish: TrajectoryFinish, reward: float, info: dict[str, Any], metrics: dict[str, float]) -> Trajectory:
        """The session's calls as one trajectory: the last segment (closed with the separator the
        template writes after a final end-of-turn token; the row's prompt when no call was made),
        the earlier ones in ``earlier_segments``, the last segment's malformed calls (the earlier
        segments' are counted in ``tool_errors/*``), and the metrics of every endpoint loop
        (``metrics`` added to them)."""
        if self.segments:
            seg = self.segments[-1]
            builder, messages = seg.builder, seg.messages
            sep = ctx.renderer.separator_ids
            if seg.stopped_on_eos and builder.turns and builder.turns[-1].role == "assistant" and (
                    len(sep) <= self.tokens_left(seg)):
                builder.append_template(sep)
        else:
            builder, messages = TrajectoryBuilder(ctx.renderer.prompt_ids(row.messages())), row.messages()
        earlier = [TrajectorySegment(s.builder.prompt_ids, s.builder.response_ids, s.builder.response_mask,
                                     s.builder.logprobs, s.builder.turns, s.builder.token_versions)
                   for s in self.segments[:-1]]
        metrics = {
            "turns": float(self.assistant_turns), "generate_calls": float(len(self.calls)),
            "tool_calls": float(self.tool_calls_returned),  # the trainer's tool_use_rate counts these
            "response_tokens": float(len(builder.response_ids)), "sampled_tokens": float(sum(builder.response_mask)),
            "gen_time_s": self.gen_time, "segment_splits": float(self.segment_splits),
            "segment_earlier_tokens": float(sum(sum(s.response_mask) for s in earlier)),
            **{f"tool_errors/{kind}": float(n) for kind, n in self.tool_errors.items()}, **metrics,
        }
        if self.weight_versions:
            metrics.update(weight_version_min=float(min(self.weight_versions)),
                           weight_version_max=float(max(self.weight_versions)))
        return Trajectory(
            row_id=row_id, group_id=group_id, sample_index=sample_index, data_source=row.data_source,
            agent_name=agent_name, prompt_ids=builder.prompt_ids, response_ids=builder.response_ids,
            response_mask=builder.response_mask, logprobs=builder.logprobs, turns=builder.turns, messages=messages,
            finish_reason=finish, reward=reward, reward_info=info, metrics=metrics, policy_version=ctx.policy_version,
            ground_truth=row.ground_truth, earlier_segments=earlier, token_versions=builder.token_versions,
            tool_calls=[c for seg, c in self.malformed_calls if seg == len(self.segments) - 1],
        )

    async def complete(self, body: dict[str, Any], *, with_tokens: bool = False) -> dict[str, Any]:
        """Serve one chat-completions request body; returns the (non-streamed) response object.
        ``with_tokens``: the ``/chat/completions/tokens`` route (the prompt is ``body["tokens"]``)."""
        async with self._lock:  # one call at a time: a trajectory's calls are ordered
            return await self._complete(body, with_tokens)

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``messages`` (with ``tools``; ``add_generation_prompt``, default
        true) rendered by the policy's chat template, or a ``prompt`` string encoded."""
        if isinstance(body.get("prompt"), str):
            ids = self.renderer.encode(body["prompt"])
        else:
            messages, tools = _messages_and_tools(body, "messages (or prompt): a non-empty list of messages is required")
            try:
                ids = self.renderer.template_ids(messages, tools or [],
                                                 add_generation_prompt=bool(body.get("add_generation_prompt", True)))
            except Exception as exc:
                raise RequestRefused(f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}",
                                     param="messages") from exc
        return {"count": len(ids), "max_model_len": self.limits.max_response_tokens + len(ids), "tokens": ids,
                "token_strs": None}

    async def _complete(self, body: dict[str, Any], with_tokens: bool = False) -> dict[str, Any]:
        if self.finish is not None:
            raise RequestRefused(f"this trajectory has ended ({self.finish.value})", finish=self.finish)
        ask = self._read(body, with_tokens)
        self.check_turn(None)  # before an observation that no turn would read
        if ask.tokens is not None:
            segment, merged = self._extend_by_tokens(ask.tokens, ask.messages, ask.tools)
        else:
            segment, merged = self._extend_or_split(ask.messages, ask.tools)
        left = self.check_turn(segment, 1) + 1  # the tokens this answer may sample
        _log_overrides(body, self.sampling, self.seed is not None)
        prompt = segment.builder.all_ids
        try:
            sampled = await sample_turn(self, self.engine, self.renderer, self.sampling, prompt, call=len(self.calls),
                                        max_new_tokens=min(self.limits.max_new_tokens, left, ask.max_tokens or left),
                                        stop=ask.stop)
        except EpisodeEnd as end:  # the engine failed (502) or aborted the request (503)
            self._end(end.reason, status=502 if end.reason is TrajectoryFinish.ENGINE_ERROR else 503)
        result = sampled.result
        self.assistant_turns += 1
        turn = segment.builder.append_sampled(result.output_ids, result.logprobs, versions=sampled.versions)
        self.calls.append(CallRecord(len(self.segments) - 1, prompt, list(result.output_ids), list(result.logprobs),
                                     result.finish_reason.value, merged))
        ids = result.output_ids
        segment.stopped_on_eos = sampled.stopped_on_eos
        text, _ = cut_at_stop(sampled.text, ask.stop, keep=ask.include_stop)  # the stop string's text is never sent
        answer, malformed = self._answer(text, ask)
        if malformed:
            self._record_malformed(malformed, len(segment.builder.turns) - 1, turn)
        tool_calls = answer.get("tool_calls") or []
        self.tool_calls_returned += len(tool_calls) + len(malformed)
        segment.messages.append(normalize_message(answer, where="response"))
        finish = "length" if result.finish_reason is FinishReason.LENGTH else "tool_calls" if tool_calls else "stop"
        choice: dict[str, Any] = {"index": 0, "message": answer, "finish_reason": finish, "logprobs": None}
        if ask.logprobs:  # as vLLM: every sampled token (the end-of-turn token too), with its own text
            choice["logprobs"] = {"content": [
                {"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                for piece, lp in zip((self.renderer.decode([i]) for i in ids), result.logprobs)]}
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL_NAME, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
        }
        if ask.token_ids:
            response["prompt_token_ids"] = list(prompt)
            choice["token_ids"] = list(ids)
        return response

    def _answer(self, text: str, ask: _Ask) -> tuple[dict[str, Any], list[ParsedCall]]:
        """The assistant message for ``text``, and the calls in it that could not be understood.

        As vLLM and SGLang answer: when every call parses, names one of the request's tools and
        has arguments its schema accepts, the calls come back as ``tool_calls`` (content: the text
        before them); otherwise the whole text comes back as content, with no ``tool_calls``,
        never with arguments of the endpoint's making."""
        parsed = self.parser.parse(text) if ask.parse_calls else None
        if parsed is None or not parsed.calls:
            return {"role": "assistant", "content": parsed.content if parsed is not None else text}, []
        schemas = {t["function"].get("name"): t["function"].get("parameters")
                   for t in ask.tools or [] if isinstance(t.get("function"), dict)}
        malformed = []
        for call in parsed.calls:
            if call.error is None and call.name not in schemas:
                call.error, call.detail = "unknown_tool", f"unknown tool {call.name!r} (available: {', '.join(map(str, schemas)) or 'none'})"
            elif call.error is None:
                problem = schema_problem(str(call.name), schemas[call.name], call.arguments or {})
                if problem is not None:
                    call.error, call.detail = "invalid_arguments", problem
            if call.error is not None:
                malformed.append(call)
        if malformed:
            return {"role": "assistant", "content": text}, malformed
        tool_calls = [{
            "id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments or {}, ensure_ascii=False)},
        } for c in parsed.calls]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}, []

    def _record_malformed(self, calls: list[ParsedCall], turn_index: int, turn: Turn) -> None:
        """Keep the calls in the trajectory with their error kind, count them, apply the policy:
        ``penalize`` adds the penalty to the turn's reward, ``end`` ends the trajectory after this
        answer (``malformed_tool_call``; a further request is refused), ``feedback`` leaves the
        answer as the program's to read."""
        for call in calls:
            self.tool_errors[call.error or "bad_json"] += 1
            self.malformed_calls.append((len(self.segments) - 1, ToolCallRecord(
                turn=turn_index, name=call.name, arguments=call.arguments, raw=call.raw, result="", error=call.error)))
        policy = self.limits.malformed_call_policy
        if policy == "penalize":
            turn.reward = (turn.reward or 0.0) + self.limits.malformed_call_penalty
        elif policy == "end":
            self.finish = TrajectoryFinish.MALFORMED_TOOL_CALL

    def tokens_left(self, segment: Segment) -> int:
        """What ``max_response_tokens`` leaves in this segment."""
        return self.limits.max_response_tokens - len(segment.builder)

    def check_turn(self, segment: Segment | None, tokens: int = 1) -> int:
        """The endpoint's one check of the turn limits (as ``Episode.check_turn`` is the loops'):
        another assistant turn, and ``tokens`` more in ``segment``; refuses the request and ends
        the trajectory with the limit's finish reason, else returns the tokens left after them."""
        if self.assistant_turns >= self.limits.max_assistant_turns:
            self._end(TrajectoryFinish.MAX_ASSISTANT_TURNS)
        if segment is None:
            return 0
        left = self.tokens_left(segment) - tokens
        if left < 0:
            self._end(TrajectoryFinish.RESPONSE_BUDGET)
        return left

    def _end(self, finish: TrajectoryFinish, *, status: int = 400) -> Any:
        self.finish = finish
        raise RequestRefused(f"the trajectory ended: {finish.value}", status=status, finish=finish)

    def _read(self, body: dict[str, Any], with_tokens: bool = False) -> _Ask:
        if body.get("top_logprobs"):  # accepted when off: only the sampled tokens' own logprobs exist here
            raise RequestRefused(f"top_logprobs={body['top_logprobs']!r}: not supported (only the sampled tokens' "
                                 "logprobs are computed: ask logprobs=true and leave top_logprobs unset)", param="top_logprobs")
        logprobs = body.get("logprobs")
        if logprobs not in (None, True, False):
            raise RequestRefused(f"logprobs={logprobs!r}: true or false is required", param="logprobs")
        tokens = body.get("tokens") if with_tokens else None
        if with_tokens:
            vocab = len(self.renderer.tokenizer)
            if (not isinstance(tokens, list) or not tokens
                    or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
                raise RequestRefused(f"tokens: a non-empty list of token ids below the vocabulary size {vocab} is required",
                                     param="tokens")
        n = body.get("n")
        if n not in (None, 1):
            raise RequestRefused(f"n={n!r}: only n=1 is supported (one trajectory samples one answer per call)", param="n")
        messages, tools = _messages_and_tools(body, "messages: a non-empty list is required")
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
        if max_tokens is not None and max_tokens > self.limits.max_new_tokens and "max_tokens" not in _logged_overrides:
            with _logged_lock:
                first = "max_tokens" not in _logged_overrides
                _logged_overrides.add("max_tokens")
            if first:
                log.warning("OpenAI endpoint: a request asked max_tokens=%d; at most rollout.max_new_tokens=%d are "
                            "sampled (said once per process)", max_tokens, self.limits.max_new_tokens)
        return _Ask(messages, tools, choice != "none", tuple(s for s in stops if s),
                    bool(body.get("include_stop_str_in_output")), max_tokens, bool(logprobs),
                    bool(body.get("return_token_ids")), tokens)

    def _extend_by_tokens(self, tokens: list[int], messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> tuple[Segment, bool]:
        """The segment whose ids so far are a proper prefix of ``tokens`` (the rest appended as
        the observation, masked, exactly as the client sent it), or a new one with ``tokens`` as
        its prompt. The messages are kept as the context of later requests."""
        if self.segments:
            seg = self.segments[-1]
            ids = seg.builder.all_ids
            if len(tokens) > len(ids) and tokens[: len(ids)] == ids:
                delta = tokens[len(ids):]
                known = len(seg.messages)
                rest = messages[known:] if messages[:known] == seg.messages else []
                role: TurnRole = "tool" if rest and rest[0]["role"] == "tool" else "user"
                self.check_turn(seg, len(delta) + 1)
                seg.builder.append_observed(delta, role)
                seg.messages, seg.tools = list(messages), tools
                return seg, True
        seg = Segment(TrajectoryBuilder(list(tokens)), list(messages), tools)
        self.segments.append(seg)
        return seg, False

    def _extend_or_split(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[Segment, bool]:
        """The segment this request continues (observation tokens appended, masked), or a new one."""
        if self.segments:
            seg = self.segments[-1]
            known = len(seg.messages)
            rest = messages[known:]
            if (tools == seg.tools and messages[:known] == seg.messages and rest
                    and all(m["role"] in ("tool", "user") for m in rest)):
                delta = self.renderer.observation_ids(rest, after_eos=seg.stopped_on_eos)
                role: TurnRole = "tool" if rest[0]["role"] == "tool" else "user"
                self.check_turn(seg, len(delta) + 1)  # the observation and at least one token to read it
                seg.builder.append_observed(delta, role)
                seg.messages.extend(rest)
                return seg, True
        try:
            prompt = self.renderer.prompt_ids(messages, tools)
        except Exception as exc:
            raise RequestRefused(f"messages: the chat template cannot render them: {type(exc).__name__}: {exc}",
                                 param="messages") from exc
        seg = Segment(TrajectoryBuilder(prompt), list(messages), tools)
        self.segments.append(seg)
        return seg, False


class OpenAIEndpoint:
    """The HTTP server: ``/s/<session>/v1/chat/completions`` and ``/s/<session>/v1/models``."""

    def __init__(self, *, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        self.host = host
        self.api_key = "sk-agentrl-" + secrets.token_urlsafe(24)
        self.sessions: dict[str, EndpointSession] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]
        app = Starlette(routes=[
            Route("/s/{sid}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/s/{sid}/v1/chat/completions/tokens", self._chat_tokens, methods=["POST"]),
            Route("/s/{sid}/v1/models", self._models, methods=["GET"]),
            # vLLM serves /tokenize beside /v1 (verifiers' token client strips the /v1 of its base_url)
            Route("/s/{sid}/tokenize", self._tokenize, methods=["POST"]),
            Route("/s/{sid}/v1/tokenize", self._tokenize, methods=["POST"]),
        ])
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._serve, name="agentrl-openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint on {host}:{self.port} did not start within {start_timeout_s} s")
            time.sleep(0.01)

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def close(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def open_session(self, session: EndpointSession) -> tuple[str, str]:
        """Register a session (on the caller's running loop); returns (base_url, api_key)."""
        session.loop = asyncio.get_running_loop()
        sid = secrets.token_urlsafe(16)
        self.sessions[sid] = session
        return f"http://{self.host}:{self.port}/s/{sid}/v1", self.api_key

    def close_session(self, base_url: str) -> None:
        sid = base_url.rstrip("/").split("/s/", 1)[1].split("/", 1)[0]
        self.sessions.pop(sid, None)

    def _session(self, request: Request) -> EndpointSession | Response:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return error_response("invalid api key", 401)
        session = self.sessions.get(request.path_params["sid"])
        if session is None or session.loop is None:
            return error_response("unknown or closed session (each trajectory has its own base_url)", 404)
        return session

    async def _models(self, request: Request) -> Response:
        found = self._session(request)
        if isinstance(found, Response):
            return found
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "agentrl"}]})

    async def _body(self, request: Request) -> tuple[EndpointSession, dict[str, Any]] | Response:
        found = self._session(request)
        if isinstance(found, Response):
            return found
        try:
            body = await request.json()
        except ValueError:
            return error_response("the request body is not JSON", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        return found, body

    async def _tokenize(self, request: Request) -> Response:
        found = await self._body(request)
        if isinstance(found, Response):
            return found
        session, body = found
        assert session.loop is not None

        async def tokenize() -> dict[str, Any]:  # on the session's loop, where its renderer is used
            return session.tokenize(body)

        try:
            return JSONResponse(await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(tokenize(), session.loop)))
        except RequestRefused as exc:
            return error_response(str(exc), exc.status, exc.param)

    async def _chat_tokens(self, request: Request) -> Response:
        return await self._chat(request, with_tokens=True)

    async def _chat(self, request: Request, with_tokens: bool = False) -> Response:
        found = await self._body(request)
        if isinstance(found, Response):
            return found
        session, body = found
        assert session.loop is not None
        future = asyncio.run_coroutine_threadsafe(session.complete(body, with_tokens=with_tokens), session.loop)
        timeout = session.limits.trajectory_timeout_s
        try:
            response = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except RequestRefused as exc:
            if exc.finish is None and session.refused is None:
                session.refused = str(exc)
            return error_response(str(exc), exc.status, exc.param)
        except asyncio.TimeoutError:
            future.cancel()
            session.crashed = session.crashed or f"the rollout engine did not answer within {timeout} s"
            return error_response(f"the rollout engine did not answer within the trajectory timeout ({timeout} s)", 504)
        except Exception as exc:  # the endpoint's own failure: infrastructure, never the program's
            session.crashed = session.crashed or f"{type(exc).__name__}: {exc}"
            log.error("OpenAI endpoint: serving a request failed", exc_info=exc)
            return JSONResponse({"error": {"message": f"the endpoint failed: {type(exc).__name__}: {exc}",
                                           "type": "server_error", "param": None, "code": None}}, status_code=500)
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(sse_stream(response, include), media_type="text/event-stream")
        return JSONResponse(response)


_endpoint: OpenAIEndpoint | None = None
_endpoint_lock = threading.Lock()


def endpoint(factory: Callable[[], OpenAIEndpoint] = OpenAIEndpoint) -> OpenAIEndpoint:
    """The process's endpoint, started on first use (one server for every concurrent session)."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            _endpoint = factory()
        return _endpoint

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

from agentrl.agent.call_stats import read_turn
from agentrl.agent.harmony import name_tool_results
from agentrl.agent.history import HistoryPolicy, fresh_request
from agentrl.agent.loop import EpisodeEnd, LoopContext, sample_turn
from agentrl.agent.openai_request import Ask, answer_text, log_overrides, messages_and_tools, read_request
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
    policy: str = ""  # the main policy; a trained role's session samples from its own (agent/openai_roles.py)
    loop: asyncio.AbstractEventLoop | None = None  # the loop the engine runs on (set by open_session)
    calls: list[CallRecord] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    assistant_turns: int = 0
    tool_calls_returned: int = 0  # calls parsed from the answers (what the policy asked to run)
    finish: TrajectoryFinish | None = None  # set when a limit or the engine ended the trajectory
    error: str | None = None
    malformed_calls: list[tuple[int, ToolCallRecord]] = field(default_factory=list)  # (segment, call) answered as text
    tool_errors: Counter[str] = field(default_factory=Counter)  # malformed calls by kind
    parse_counts: Counter[str] = field(default_factory=Counter)  # tool_calls/parsed, ... (agentrl.agent.call_stats)
    refused: str | None = None  # the first request refused with a 4xx that did not end the trajectory
    crashed: str | None = None  # the endpoint's own failure serving a request (answered 500)
    weight_versions: list[int] = field(default_factory=list)
    gen_time: float = 0.0
    history: HistoryPolicy = "as_template"  # agent.history: extending requests checked against a fresh rendering
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def for_trajectory(cls, ctx: LoopContext, loop_name: str, *, row_id: str, sample_index: int,
                       seed: int | None) -> EndpointSession:
        """The session of one trajectory of the loop ``loop_name`` (its tool parser), on the rollout's engine."""
        return cls(engine=ctx.engine, renderer=ctx.renderer, parser=ctx.parser_for(loop_name), limits=ctx.limits,
                   sampling=ctx.sampling, session_id=f"{row_id}#{sample_index}", seed=seed, history=ctx.history_for(loop_name))

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
            **{f"tool_errors/{kind}": float(n) for kind, n in self.tool_errors.items()},
            **{key: float(n) for key, n in self.parse_counts.items()}, **metrics,
        }
        if self.weight_versions:
            metrics.update(weight_version_min=float(min(self.weight_versions)),
                           weight_version_max=float(max(self.weight_versions)))
        return Trajectory(
            row_id=row_id, group_id=group_id, sample_index=sample_index, data_source=row.data_source,
            agent_name=agent_name, prompt_ids=builder.prompt_ids, response_ids=builder.response_ids,
            response_mask=builder.response_mask, logprobs=builder.logprobs, turns=builder.turns, messages=messages,
            finish_reason=finish, reward=reward, reward_info=info, metrics=metrics, policy_version=ctx.version_of(self.policy),
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
            messages, tools = messages_and_tools(body, "messages (or prompt): a non-empty list of messages is required")
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
        ask = read_request(body, vocab=len(self.renderer.tokenizer), max_new_tokens=self.limits.max_new_tokens,
                           with_tokens=with_tokens)
        self.check_turn(None)  # before an observation that no turn would read
        if ask.tokens is not None:
            segment, merged = self._extend_by_tokens(ask.tokens, ask.messages, ask.tools)
        else:
            segment, merged = self._extend_or_split(ask.messages, ask.tools)
        left = self.check_turn(segment, 1) + 1  # the tokens this answer may sample
        log_overrides(body, self.sampling, self.seed is not None)
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
        sampled_text, segment.stopped_on_eos = answer_text(sampled, self.renderer,
                                                           self.sampling.stop_token_ids or (self.renderer.eos_id,))
        ended = "stop" if segment.stopped_on_eos else result.finish_reason.value  # the model ended its turn
        self.calls.append(CallRecord(len(self.segments) - 1, prompt, list(result.output_ids), list(result.logprobs),
                                     ended, merged))
        ids = result.output_ids
        text, _ = cut_at_stop(sampled_text, ask.stop, keep=ask.include_stop)  # the stop string's text is never sent
        answer, malformed = self._answer(text, ask)
        if malformed:
            self._record_malformed(malformed, len(segment.builder.turns) - 1, turn)
        tool_calls = answer.get("tool_calls") or []
        self.tool_calls_returned += len(tool_calls) + len(malformed)
        segment.messages.append(normalize_message(answer, where="response"))
        finish = "length" if ended == FinishReason.LENGTH.value else "tool_calls" if tool_calls else "stop"
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

    def _answer(self, text: str, ask: Ask) -> tuple[dict[str, Any], list[ParsedCall]]:
        """The assistant message for ``text``, and the calls in it that could not be understood.

        As vLLM and SGLang answer: when every call parses, names one of the request's tools and
        has arguments its schema accepts, the calls come back as ``tool_calls`` (content: the text
        before them); otherwise the whole text comes back as content, with no ``tool_calls``,
        never with arguments of the endpoint's making."""
        parsed = read_turn(self.parser, text, ask.tools or [], self.parse_counts) if ask.parse_calls else None
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
                shown = name_tool_results(self.renderer, seg.messages, rest)  # gpt-oss names a result after its call
                text = self.renderer.observation_text(shown, after_eos=seg.stopped_on_eos)
                if fresh_request(self.renderer, self.history, seg.builder.all_ids, text, messages, tools) is None:
                    delta, role = self.renderer.encode(text), ("tool" if rest[0]["role"] == "tool" else "user")
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

"""The OpenAI chat-completions wire format as the endpoint reads and writes it: messages as the
chat template renders them, the error body, the server-sent-events stream, and the refusal that
answers a request with a 4xx naming its field (``agentrl.agent.openai_endpoint``); and, on the
client's side, whether a program's exception was a failure to reach the endpoint
(``is_transport_error``: the loops that run programs against the endpoint keep those out of the loss)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse

from agentrl.trajectory import TrajectoryFinish

__all__ = ["MODEL_NAME", "RequestRefused", "normalize_message", "error_response", "sse_stream", "is_transport_error"]

MODEL_NAME = "agentrl-policy"


class RequestRefused(Exception):
    """A request the endpoint will not serve: answered with ``status`` and an OpenAI error body
    naming the field; ``finish`` set when the refusal ends the trajectory (a limit)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 finish: TrajectoryFinish | None = None):
        super().__init__(message)
        self.param, self.status, self.finish = param, status, finish


def normalize_message(message: Any, *, where: str) -> dict[str, Any]:
    """A chat message as the template renders it and as the context comparison sees it: role,
    text content, tool calls with their arguments parsed; what a client adds beside is dropped."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestRefused(f"{where}: a message object with a 'role' is required", param="messages")
    role = message["role"]
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestRefused(f"{where}.role={role!r}: unsupported role", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestRefused(f"{where}.content: only text parts are supported, not {kind!r}", param="messages")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    out: dict[str, Any] = {"role": role, "content": content if isinstance(content, str) else ""}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise RequestRefused(f"{where}.tool_calls[{j}].function is required", param="messages")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise RequestRefused(f"{where}.tool_calls[{j}].function.arguments is not JSON", param="messages") from None
            entry: dict[str, Any] = {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}
            if call.get("id"):
                entry["id"] = call["id"]
            out["tool_calls"].append(entry)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key):
                out[key] = message[key]
    return out


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}},
                        status_code=status)


async def sse_stream(response: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """The answer as a chat.completion.chunk stream (one chunk per part: generation is not
    streamed token by token, the answer is complete when the first chunk is sent)."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"], "model": MODEL_NAME}
    choice = response["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": response["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from (``__cause__`` / ``__context__``), is a
    failure to reach the endpoint: no connection, a timeout, httpx's ``TransportError``, openai's
    ``APIConnectionError`` or an ``APIStatusError`` of 5xx. The HTTP libraries are looked up, never
    imported here: a first import on this thread while a program's thread uses the library would
    show that thread a partly initialised module."""
    transport: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, asyncio.TimeoutError)
    for name in ("httpx", "httpx2"):  # the program's HTTP client, if it has imported one
        error = getattr(sys.modules.get(name), "TransportError", None)
        if isinstance(error, type):
            transport += (error,)
    openai = sys.modules.get("openai")  # imported by the program when it uses the client
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, transport):
            return True
        if openai is not None and (isinstance(current, openai.APIConnectionError) or (
                isinstance(current, openai.APIStatusError) and current.status_code >= 500)):
            return True
        current = current.__cause__ or current.__context__
    return False

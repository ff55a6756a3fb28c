"""The front door every agentrl HTTP server shares: an API key and a bound on request bodies.

``Guard`` wraps an ASGI app:

* **API key.** When the server has a key, every request must carry ``Authorization: Bearer
  <key>`` (SGLang's ``--api-key`` convention, so one client speaks to both) or is answered
  401 before it reaches a handler. The comparison is ``hmac.compare_digest`` (its time does not
  depend on how much of the key matched). The one open path is ``GET /health``: it answers
  200 or 503 with an empty body, computes nothing and reveals nothing but liveness, so load
  balancers and probes need no secret. (SGLang leaves every path starting with ``/health``,
  ``/ready`` and ``/metrics`` open; here ``/health_generate``, which runs the model, needs the
  key.)
* **Body size.** A body larger than ``max_body_bytes`` is answered 413, by its
  ``Content-Length`` before it is read, or as soon as a chunked body passes the bound.

Where the key comes from: the ``AGENTRL_API_KEY`` environment variable or a key file; the
servers ``launch.py`` starts get a fresh one per launch (``new_api_key``) through that variable,
never on a command line (SGLang takes it as ``--api-key``, its only way). A server on a
non-loopback address without a key is refused at start (``require_key_off_loopback``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from pathlib import Path
from typing import Any, Awaitable, Callable

__all__ = [
    "API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES", "OPEN_PATHS", "Guard", "new_api_key", "api_key_from_env",
    "read_key_file", "is_loopback", "require_key_off_loopback", "auth_headers",
]

API_KEY_ENV = "AGENTRL_API_KEY"
# A /generate batch of 64 prompts of 32k token ids is about 14 MB of JSON.
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
OPEN_PATHS = frozenset({"/health"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def new_api_key() -> str:
    """A fresh random key (256 bits) for one run's servers. The prefix keeps it from starting with
    ``-`` (one key in 64 would): SGLang's command line reads ``--api-key -x...`` as a missing value."""
    return "agentrl-" + secrets.token_urlsafe(32)


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def read_key_file(path: str | Path) -> str:
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``; any other name counts as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key_off_loopback(host: str, api_key: str | None, *, program: str) -> None:
    """Refuse to listen beyond this machine without a key: anyone reaching the port could swap
    the policy's weights or abort every rollout."""
    if api_key or is_loopback(host):
        return
    raise ValueError(
        f"{program}: --host {host} is not a loopback address and no API key is set, so anyone who reaches the port "
        f"could call every endpoint (swap the weights, abort requests). Set a key: "
        f"export {API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))') "
        f"(or --api-key-file PATH), and give clients the same key (api_key=..., or the same {API_KEY_ENV})"
    )


class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: the API key check, then the body size bound (see the module docstring)."""

    def __init__(self, app: Callable, *, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 open_paths: frozenset[str] = OPEN_PATHS):
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key is not None and not (scope["method"] in ("GET", "HEAD") and scope["path"] in self.open_paths):
            if not self._authorized(scope):
                await _send_json(send, 401, "missing or wrong API key: send Authorization: Bearer <key>",
                                 [(b"www-authenticate", b"Bearer")])
                return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_json(send, 413, f"the body has {declared} bytes; this server takes at most {self.max_body_bytes}")
            return
        seen = 0
        started = False

        async def bounded_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_json(send, 413, f"the body is larger than the {self.max_body_bytes} bytes this server takes")

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest on bytes of any length: no early exit on the first differing byte
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_json(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})

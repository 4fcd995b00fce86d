"""Two pure ASGI middlewares that run before any route: request ids and the body size limit.

The body limit refuses a request body larger than ``max_body_bytes`` with 413
PAYLOAD_TOO_LARGE *before* the body is parsed: a Content-Length over the limit is refused at
once without reading a byte; a chunked body is read chunk by chunk and refused as soon as the
running total passes the limit, so at most ``max_body_bytes`` plus one chunk is ever held in
memory, whatever the client sends. The exact payload rule (the UTF-8 bytes of the payload's
compact JSON, DESIGN 10) is applied afterwards by :meth:`dtq.models.SubmitRequest.build`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ENVELOPE_BYTES",
    "BodyLimitMiddleware",
    "RequestIdMiddleware",
    "max_body_bytes",
    "valid_request_id",
]

ENVELOPE_BYTES = 65_536
"""Allowance over DTQ_MAX_PAYLOAD_BYTES for the rest of a submit body: the other fields,
metadata (at most 4 KiB), and the whitespace and escapes a client's JSON encoder may add."""

REQUEST_ID_MAX = 128
_REQUEST_ID_RE = re.compile(rf"[\x20-\x7e]{{1,{REQUEST_ID_MAX}}}")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def max_body_bytes(max_payload_bytes: int) -> int:
    """The largest request body the API reads: the payload limit plus the envelope."""
    return max_payload_bytes + ENVELOPE_BYTES


def valid_request_id(value: str | None) -> bool:
    """Printable ASCII, 1-128 characters: safe to echo in a header and to log."""
    return value is not None and _REQUEST_ID_RE.fullmatch(value) is not None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class RequestIdMiddleware:
    """Accept a valid ``X-Request-ID`` or make one; put it in ``scope["state"]`` and echo it
    on every response (errors and the 413 of the body limit included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given is not None and valid_request_id(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", raw))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413 before the app parses them;
    ``on_refuse(path)`` is told of each refusal (metrics)."""

    def __init__(
        self, app: ASGIApp, limit: int, on_refuse: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.limit = limit
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                await self._refuse(scope, send, declared)
                return
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; nothing to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                # Stop reading here: the rest of the body is never pulled from the client.
                await self._refuse(scope, send, None)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, declared: int | None) -> None:
        if self.on_refuse is not None:
            self.on_refuse(str(scope.get("path", "")))
        details: dict[str, Any] = {"limit": self.limit}
        if declared is not None:
            details["content_length"] = declared
        payload = {
            "error": {
                "code": "PAYLOAD_TOO_LARGE",
                "message": f"request body is larger than {self.limit} bytes",
                "details": details,
            }
        }
        data = json.dumps(payload, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    # The unread rest of the body makes the connection unusable.
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})

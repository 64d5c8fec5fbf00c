"""Request ids over HTTP: taken from ``X-Request-ID`` or made up (``app.requestid``), echoed,
and the time each request reached the server."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.requestid import current_request_id, new_request_id, request_id_from


def request_id_of(scope: MutableMapping[str, Any]) -> str | None:
    state = scope.get("state") or {}
    value = state.get("request_id")
    return value if isinstance(value, str) else None


def request_start_of(scope: MutableMapping[str, Any]) -> float:
    """``time.perf_counter()`` when the request reached the server (now, if unknown)."""
    state = scope.get("state") or {}
    value = state.get("request_start")
    return value if isinstance(value, float) else time.perf_counter()


class RequestIdMiddleware:
    """Plain ASGI (not ``BaseHTTPMiddleware``, which breaks disconnect detection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                # Only echo ids that are safe in headers and logs; otherwise make our own.
                request_id = request_id_from(value.decode("latin-1"))
                break
        if request_id is None:
            request_id = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["request_start"] = start
        raw_id = request_id.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", raw_id)]
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)

"""Request ids: taken from ``X-Request-ID`` or made up, echoed, and attached to log records."""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_VALID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)


def request_id_from(candidate: str | None) -> str:
    """``candidate`` when it is safe in headers and logs, else a new id."""
    if candidate is not None and _VALID.fullmatch(candidate):
        return candidate
    return uuid.uuid4().hex


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
                candidate = value.decode("latin-1")
                # Only echo ids that are safe in headers and logs; otherwise make our own.
                if _VALID.fullmatch(candidate):
                    request_id = candidate
                break
        if request_id is None:
            request_id = uuid.uuid4().hex
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


class RequestIdLogFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True

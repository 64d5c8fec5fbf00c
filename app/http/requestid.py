"""Request ids: taken from ``X-Request-ID`` or made up, echoed, and attached to log records."""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
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


class _Ids:
    """32 hex digits: this process's random half, then a count. ``uuid4`` would read the
    kernel's random source for every request, a system call that lets the event loop's thread
    lose the GIL to a decode or batch thread; a forked child draws a random half of its own."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = uuid.uuid4().hex[:16]
        self.count = itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self.count) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


new_request_id = _Ids().new


def request_id_from(candidate: str | None) -> str:
    """``candidate`` when it is safe in headers and logs, else a new id."""
    if candidate is not None and _VALID.fullmatch(candidate):
        return candidate
    return new_request_id()


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


class RequestIdLogFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True

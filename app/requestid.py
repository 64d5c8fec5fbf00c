"""Request ids, whatever the transport: taken from the client (``X-Request-ID``, or the
``x-request-id`` call metadata) when safe, else made up, and attached to log records."""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import re
import uuid

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


class RequestIdLogFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get() or "-"
        return True

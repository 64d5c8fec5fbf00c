"""Logging set-up: plain text or one JSON object per line, both with the request id."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

from app.requestid import RequestIdLogFilter

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
_HANDLER_NAME = "batchserve"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(level: str, json_lines: bool) -> None:
    """Write the records of ``batchserve``, ``batching`` and of libraries that log through the
    root logger to stderr, once each, as text or JSON lines (uvicorn keeps its own handlers).

    The handler goes on the root logger, beside any that something else put there (a test's),
    replacing only one an earlier call put there. On the ``batchserve`` logger itself, it would
    print every record twice as soon as a library logged through the root logger with no handler
    there (OpenVINO's telemetry does, where the home directory is read-only): ``logging`` then
    gives the root logger a handler of its own.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(_TEXT_FORMAT))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    root.handlers = [each for each in root.handlers if each.get_name() != _HANDLER_NAME]
    root.addHandler(handler)
    for name in ("batchserve", "batching"):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())

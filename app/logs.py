"""Logging set-up: plain text or one JSON object per line, both with the request id."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

from app.requestid import RequestIdLogFilter

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


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
    """Give the ``batchserve`` and ``batching`` loggers a handler (uvicorn keeps its own).

    They still propagate, so a handler on the root logger (a test's, say) sees records too.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(_TEXT_FORMAT))
    for name in ("batchserve", "batching"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level.upper())

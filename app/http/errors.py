"""The one place where errors become HTTP responses: ``{"error": {"code", "message"}}``, or
the Open Inference Protocol's ``{"error": "message"}`` under ``/v2``. An unexpected error is
logged with the request id and answered 500 ``internal_error``, never with a traceback."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.errors import ErrorInfo, ServiceError, describe
from app.http.requestid import request_id_of
from app.http.responses import json_response
from batching import BatcherClosedError, DeadlineExceededError, QueueFullError
from preprocessing import ImageTooLargeError, InvalidImageError, UnsupportedFormatError

logger = logging.getLogger("batchserve")


PROTOCOL_PREFIX = "/v2"


def error_response(
    info: ErrorInfo, headers: dict[str, str] | None = None, *, protocol: bool = False
) -> Response:
    """``{"error": {"code", "message"}}``; with ``protocol``, the Open Inference Protocol's
    ``{"error": "message"}``."""
    body: dict[str, Any] = (
        {"error": info.message}
        if protocol
        else {"error": {"code": info.code, "message": info.message}}
    )
    return json_response(body, status_code=info.status, headers={**info.headers, **(headers or {})})


def speaks_protocol(request: Request) -> bool:
    path: str = request.scope.get("path", "")
    return path == PROTOCOL_PREFIX or path.startswith(PROTOCOL_PREFIX + "/")


def mark_outcome(scope: MutableMapping[str, Any], outcome: str) -> None:
    """Record how this request ended, for ``batchserve_requests_total{outcome}``."""
    scope.setdefault("state", {})["outcome"] = outcome


def answer_error(
    request: Request, exc: BaseException, headers: dict[str, str] | None = None
) -> Response:
    """The response for ``exc``; an unexpected one is logged with the request id first."""
    info = describe(exc)
    if info.code == "internal_error":
        log_unexpected(exc, request_id_of(request.scope))
    mark_outcome(request.scope, info.outcome)
    return error_response(info, headers, protocol=speaks_protocol(request))


def log_unexpected(exc: BaseException, request_id: str | None) -> None:
    logger.error("unhandled error while serving request %s", request_id or "-", exc_info=exc)


_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the JSON shape ``{"error": {"code", "message"}}``."""

    async def service_error(request: Request, exc: Exception) -> Response:
        return answer_error(request, exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error.get("loc", ()) if part != "query")
            problems.append(f"{where}: {error.get('msg', 'invalid')}")
        message = "; ".join(problems) or "invalid parameters"
        mark_outcome(request.scope, "invalid")
        info = ErrorInfo(422, "invalid_parameter", message, "invalid", {})
        return error_response(info, protocol=speaks_protocol(request))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        headers = dict(exc.headers or {})
        mark_outcome(request.scope, "invalid")
        info = ErrorInfo(exc.status_code, code, detail, "invalid", headers)
        return error_response(info, protocol=speaks_protocol(request))

    async def unexpected(request: Request, exc: Exception) -> Response:
        return answer_error(request, exc)

    for error_type in (
        ServiceError,
        InvalidImageError,
        ImageTooLargeError,
        UnsupportedFormatError,
        QueueFullError,
        DeadlineExceededError,
        BatcherClosedError,
    ):
        app.add_exception_handler(error_type, service_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)

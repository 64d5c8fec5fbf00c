"""The one place where errors become HTTP responses.

Every error a client can see has a stable ``code``, a status and a message that is safe to
show; everything else is logged with the request id and answered 500 ``internal_error``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.requestid import request_id_of
from app.responses import json_response
from batching import BatcherClosedError, DeadlineExceededError, QueueFullError
from preprocessing import ImageTooLargeError, InvalidImageError, UnsupportedFormatError

logger = logging.getLogger("batchserve")


class ServiceError(Exception):
    """An error the server answers on purpose. Subclasses fix status and code."""

    status = 500
    code = "internal_error"
    outcome = "error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequestError(ServiceError):
    status, code, outcome = 400, "invalid_request", "invalid"


class UnauthorizedError(ServiceError):
    status, code, outcome = 401, "unauthorized", "unauthorized"


class PayloadTooLargeError(ServiceError):
    status, code, outcome = 413, "too_large", "invalid"


class NotFoundError(ServiceError):
    status, code, outcome = 404, "not_found", "invalid"


class UnsupportedMediaTypeError(ServiceError):
    status, code, outcome = 415, "unsupported_media_type", "invalid"


class InvalidParameterError(ServiceError):
    status, code, outcome = 422, "invalid_parameter", "invalid"


class InvalidInputError(InvalidParameterError):
    """Inputs that do not fit the model: their count, shape, datatype or values (422)."""


class NotReadyError(ServiceError):
    status, code, outcome = 503, "not_ready", "not_ready"


class OverloadedError(ServiceError):
    """Admitting one more request would exceed ``MAX_QUEUE_SIZE`` or ``MAX_QUEUE_BYTES``."""

    status, code, outcome = 503, "overloaded", "overloaded"


@dataclass(frozen=True)
class ErrorInfo:
    status: int
    code: str
    message: str
    outcome: str
    headers: dict[str, str]


def describe(exc: BaseException) -> ErrorInfo:
    """Status, code, client-safe message and metrics outcome of any exception."""
    if isinstance(exc, ServiceError):
        return ErrorInfo(exc.status, exc.code, exc.message, exc.outcome, exc.headers)
    if isinstance(exc, InvalidImageError):
        return ErrorInfo(400, "invalid_image", str(exc), "invalid", {})
    if isinstance(exc, ImageTooLargeError):
        return ErrorInfo(413, "too_large", str(exc), "invalid", {})
    if isinstance(exc, UnsupportedFormatError):
        return ErrorInfo(415, "unsupported_media_type", str(exc), "invalid", {})
    if isinstance(exc, QueueFullError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        message = "the server is at capacity; retry later"
        return ErrorInfo(503, "overloaded", message, "overloaded", {"Retry-After": retry})
    if isinstance(exc, DeadlineExceededError):
        return ErrorInfo(504, "deadline_exceeded", str(exc), "deadline_exceeded", {})
    if isinstance(exc, BatcherClosedError):
        return ErrorInfo(503, "not_ready", str(exc), "not_ready", {"Retry-After": "1"})
    if isinstance(exc, torch.OutOfMemoryError):
        message = "the device ran out of memory, even for this image alone; retry later"
        return ErrorInfo(503, "out_of_memory", message, "error", {"Retry-After": "1"})
    return ErrorInfo(500, "internal_error", "internal server error", "error", {})


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

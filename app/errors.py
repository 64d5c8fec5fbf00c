"""The errors a client can see, in one small hierarchy, and what each one is.

Every such error has a stable ``code``, a status and a message that is safe to show; anything
else is an internal error, logged with the request id and answered 500 ``internal_error``.
The status is HTTP's (each front end maps the code to its own: ``app.http.errors`` answers
HTTP, a gRPC front end would map to gRPC status codes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batching import BatcherClosedError, DeadlineExceededError, QueueFullError
from preprocessing import ImageTooLargeError, InvalidImageError, UnsupportedFormatError


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

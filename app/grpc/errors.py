"""The one place where errors become gRPC statuses.

The same errors as over HTTP (``app.errors.describe``), each to the status its meaning has in
gRPC: a bad input, tensor or parameter is ``INVALID_ARGUMENT``, an unknown model or version
``NOT_FOUND``, a missing key ``UNAUTHENTICATED``, a refusal by admission, a server that is not
ready or draining ``UNAVAILABLE`` with a retry hint (``retry-after`` in seconds, and gRPC's own
``grpc-retry-pushback-ms`` that its retry policies follow), a request too large
``RESOURCE_EXHAUSTED``, a deadline ``DEADLINE_EXCEEDED``; anything else ``INTERNAL``, logged with
the request id, never with a traceback to the client.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc

from app.errors import ErrorInfo, describe

logger = logging.getLogger("batchserve")

_BY_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(info: ErrorInfo) -> grpc.StatusCode:
    return _BY_STATUS.get(info.status, grpc.StatusCode.INTERNAL)


async def abort_with(
    context: Any, exc: BaseException, request_id: str, scope: dict[str, str]
) -> NoReturn:
    """End the call with ``exc``'s status (``scope["outcome"]`` says how, for the metrics)."""
    info = describe(exc)
    scope["outcome"] = info.outcome
    if info.code == "internal_error":
        logger.error("unhandled error while serving gRPC call %s", request_id, exc_info=exc)
    trailers = [("x-request-id", request_id)]
    retry = info.headers.get("Retry-After")
    if retry is not None:
        trailers += [("retry-after", retry), ("grpc-retry-pushback-ms", str(int(retry) * 1000))]
    context.set_trailing_metadata(tuple(trailers))
    # The abort raises while ``exc`` is being handled, and gRPC keeps what it raises until the
    # call is finished: without its traceback, ``exc`` no longer holds the frames it passed
    # through (and the request message in them) in a cycle only the collector would free.
    exc.__traceback__ = None
    await context.abort(status_of(info), info.message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover

"""The API key over gRPC, checked before a call's message is read.

An interceptor sees a call's method and metadata as soon as its headers arrive. A call without
the key (``authorization: Bearer <key>``, as over HTTP) is answered ``UNAUTHENTICATED`` by a
handler that reads no message: gRPC takes a handler that streams its requests at its word and
reads a message only when the handler asks for one, so the bytes a client sends are never
received, whatever their size. Health (``grpc.health.v1``, ``ServerLive``, ``ServerReady``,
``ModelReady``) stays open, as the health routes do over HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from app.auth import authorized
from app.errors import UnauthorizedError
from app.grpc.errors import abort_with
from app.requestid import HEADER, request_id_from
from app.settings import Settings

INFERENCE = "inference.GRPCInferenceService"
OPEN_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    f"/{INFERENCE}/ServerLive",
    f"/{INFERENCE}/ServerReady",
    f"/{INFERENCE}/ModelReady",
})  # fmt: skip
INFER_METHOD = f"/{INFERENCE}/ModelInfer"
MESSAGE = "missing or wrong API key: send 'authorization: Bearer <key>'"

# Told of every ModelInfer call refused here, with the seconds it took (for the metrics).
Refused = Callable[[float], None]


class KeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuse every call but health that lacks the API key (nothing to do without one)."""

    def __init__(self, settings: Settings, on_refused_infer: Refused | None = None) -> None:
        self._key = settings.api_key
        self._on_refused_infer = on_refused_infer

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or self._key is None or details.method in OPEN_METHODS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if authorized(_text(metadata.get("authorization")), self._key):
            return handler
        return self._refusal(handler, details.method, _text(metadata.get(HEADER)))

    def _refusal(self, handler: Any, method: str, request_id: str | None) -> Any:
        arrived = time.perf_counter()
        on_refused = self._on_refused_infer if method == INFER_METHOD else None

        async def refuse(requests: Any, context: Any) -> None:  # reads none of ``requests``
            try:
                await abort_with(context, UnauthorizedError(MESSAGE), request_id_from(request_id),
                                 {})  # fmt: skip
            finally:
                if on_refused is not None:
                    on_refused(time.perf_counter() - arrived)

        serializer = handler.response_serializer
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=serializer)
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=serializer)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None

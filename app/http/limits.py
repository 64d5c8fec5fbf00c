"""Request-header size limit, enforced before any routing."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send


class HeaderLimitMiddleware:
    """Answer 431 when a request's headers exceed ``max_bytes`` in total.

    uvicorn's httptools parser sets no limit of its own, and every later layer (routing,
    logging, metrics) would handle the oversized headers again.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_bytes:
                body = orjson.dumps({"error": {
                    "code": "headers_too_large",
                    "message": f"request headers exceed {self.max_bytes} bytes",
                }})  # fmt: skip
                await send({
                    "type": "http.response.start",
                    "status": 431,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")],
                })  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

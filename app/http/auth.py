"""Optional bearer-token authentication."""

from __future__ import annotations

import hmac

from fastapi import Request

from app.errors import UnauthorizedError
from app.http.state import server_state


async def require_api_key(request: Request) -> None:
    """With ``BATCHSERVE_API_KEY`` set, demand ``Authorization: Bearer <key>``.

    The comparison takes the same time for every wrong key; the answer is the same whether the
    header is missing or wrong. A coroutine, so that FastAPI runs it inline: a plain function
    dependency would cost every request a hop through the thread pool.
    """
    expected = server_state(request).settings.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, expected.get_secret_value().encode()):
        raise UnauthorizedError(
            "a valid API key is required", headers={"WWW-Authenticate": "Bearer"}
        )

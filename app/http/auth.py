"""Optional bearer-token authentication."""

from __future__ import annotations

from fastapi import Request

from app.auth import authorized
from app.errors import UnauthorizedError
from app.http.state import server_state


async def require_api_key(request: Request) -> None:
    """With ``BATCHSERVE_API_KEY`` set, demand ``Authorization: Bearer <key>``.

    The answer is the same whether the header is missing or wrong. A coroutine, so that
    FastAPI runs it inline: a plain function dependency would cost every request a hop through
    the thread pool.
    """
    key = server_state(request).settings.api_key
    if not authorized(request.headers.get("authorization"), key):
        raise UnauthorizedError(
            "a valid API key is required", headers={"WWW-Authenticate": "Bearer"}
        )

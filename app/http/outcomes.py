"""Count and time every answer of the prediction routes by outcome, in one place.

Plain ASGI, outside everything else the app adds, so that answers given before a route runs
(431 for oversized headers, 401 from the authentication dependency, 422 from parameter
validation) are counted exactly like the route's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The status code alone, when no handler said more (e.g. 503 could be overloaded or not_ready:
# every 503 the server gives on purpose goes through a handler that says which).
_BY_STATUS = {401: "unauthorized", 499: "cancelled", 503: "not_ready", 504: "deadline_exceeded"}


def outcome_of(status: int | None, marked: object) -> str:
    if isinstance(marked, str):
        return marked
    if status is None:
        return "cancelled"  # nothing was sent: the client went away first
    if status < 400:
        return "ok"
    return _BY_STATUS.get(status, "invalid" if status < 500 else "error")


class OutcomeMiddleware:
    """Calls ``count(route, outcome, model, seconds)`` once for every request whose path
    ``route_of`` names (None: not a prediction route, not counted); ``model`` is what the route
    marked (``mark_model``), empty when it found none; ``seconds`` runs from the request's
    arrival here to its answer."""

    def __init__(
        self,
        app: ASGIApp,
        route_of: Callable[[str], str | None],
        count: Callable[[str, str, str, float], None],
    ) -> None:
        self.app = app
        self.route_of = route_of
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.route_of(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        status: int | None = None

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        def count(outcome: str) -> None:
            model = str((scope.get("state") or {}).get("model", ""))
            self.count(route, outcome, model, time.perf_counter() - arrived)

        try:
            await self.app(scope, receive, send_and_watch)
        except asyncio.CancelledError:
            count("cancelled")
            raise
        except BaseException:
            count("error")  # answered 500 by the server error handler outside us
            raise
        state = scope.get("state") or {}
        count(outcome_of(status, state.get("outcome")))

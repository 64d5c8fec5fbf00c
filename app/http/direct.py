"""The prediction routes, dispatched straight from the middleware stack.

Every other route goes through FastAPI's router (a scan of every route with version
bookkeeping of included routers), Starlette's exception middleware and
prometheus-fastapi-instrumentator (which looks the route up once more, even for the routes it
excludes). On a small CPU that cost a prediction about 0.1 ms of the event loop's time
(the ``event_loop`` study), on the thread every request and every batch hand-off needs. Here
``POST`` to a prediction route runs its handler at once, with a Starlette ``Request`` and the
same error answers (``answer_error``, the one mapping). FastAPI still documents the routes,
and answers every other method on their paths (405) as before.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.errors import answer_error

Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True)
class DirectRoute:
    """``POST`` to a path that ``pattern`` matches in full: ``handle(request, path_params)``
    (the pattern's named groups that matched)."""

    name: str
    pattern: re.Pattern[str]
    handle: Handler

    def params(self, path: str) -> dict[str, str] | None:
        match = self.pattern.fullmatch(path)
        if match is None:
            return None
        return {key: value for key, value in match.groupdict().items() if value is not None}


def route_named(routes: Sequence[DirectRoute], path: str) -> str | None:
    """The name of the route whose pattern matches ``path``, whatever the method."""
    for route in routes:
        if route.pattern.fullmatch(path):
            return route.name
    return None


def route_path(scope: Scope) -> str:
    """The path as routes see it: under ``root_path`` when the server is mounted there (as
    Starlette's router reads it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return "" if root and path == root else path


class DirectRoutes:
    """Plain ASGI: ``POST`` to one of ``routes`` runs its handler; anything else goes on to
    ``app``."""

    def __init__(self, app: ASGIApp, routes: Sequence[DirectRoute]) -> None:
        self.app = app
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = route_path(scope)
            for route in self.routes:
                params = route.params(path)
                if params is not None:
                    scope["path_params"] = params
                    response = await _answer(route, Request(scope, receive, send), params)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _answer(route: DirectRoute, request: Request, params: dict[str, str]) -> Response:
    try:
        return await route.handle(request, params)
    except Exception as exc:  # what the handler raised before its own guard: auth, parameters
        return answer_error(request, exc)

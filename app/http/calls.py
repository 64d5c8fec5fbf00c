"""What every HTTP prediction route does around its one call into the serving core: the drain
count, errors in the route's shape, the model's name for the metrics, and noticing when the
client hangs up.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive

from app.http.errors import answer_error, mark_outcome
from app.http.requestid import request_start_of
from app.http.state import ServerState, server_state
from app.serving.inference import Cancelled

# No status is ever delivered to a client that hung up; 499 is what nginx logs for it.
CLIENT_CLOSED = 499

ErrorResponder = Callable[[Request, BaseException, dict[str, str]], Response]


async def guarded(
    request: Request,
    handle: Callable[[ServerState], Awaitable[Response]],
    respond: ErrorResponder = answer_error,
) -> Response:
    """Run a prediction handler: counted for the drain, a hang-up answered 499, every error
    answered by ``respond`` (the route's error shape) with the time it took."""
    server = server_state(request)
    server.enter()
    try:
        return await handle(server)
    except (Cancelled, ClientDisconnect):  # while waiting, or while uploading
        mark_outcome(request.scope, "cancelled")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        elapsed = time.perf_counter() - request_start_of(request.scope)
        return respond(request, exc, {"Server-Timing": f"total;dur={elapsed * 1000:.3f}"})
    finally:
        server.leave()


def mark_model(scope: MutableMapping[str, Any], model: str) -> None:
    """Name the model this request is for, for ``batchserve_requests_total{model}``."""
    scope.setdefault("state", {})["model"] = model


async def disconnected(receive: Receive) -> None:
    """Completes when the client hangs up."""
    while (await receive())["type"] != "http.disconnect":
        pass

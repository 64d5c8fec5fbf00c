"""What every prediction route does between reading its images and answering: admission,
decoding, deadlines, priorities, the batcher, and withdrawing when the client hangs up.

``/predict`` (one image) and the Open Inference Protocol (several images per request) both
run their images through here, so that each image is one batcher item, whatever the route.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive

from app.admission import Ticket
from app.body import declared_length
from app.engine import InferenceRequest, Prediction
from app.errors import InvalidParameterError, OverloadedError, answer_error, mark_outcome
from app.requestid import request_start_of
from app.state import ServerState, Serving, server_state
from preprocessing import Buffer, PreparedImage

# No status is ever delivered to a client that hung up; 499 is what nginx logs for it.
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client hung up while its request was waiting."""


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
    except (ClientDisconnected, ClientDisconnect):  # while waiting, or while uploading
        mark_outcome(request.scope, "cancelled")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        elapsed = time.perf_counter() - request_start_of(request.scope)
        return respond(request, exc, {"Server-Timing": f"total;dur={elapsed * 1000:.3f}"})
    finally:
        server.leave()


@dataclass(frozen=True)
class Call:
    """When a prediction request must be answered by, and how urgent it is."""

    deadline: float  # on the batcher's clock
    level: int  # the batcher's priority level (0 first)


def call_for(
    request: Request, serving: Serving, timeout_s: float | None, priority: int | None
) -> Call:
    """``timeout_s`` (None: the server's default) counts from the request's arrival;
    ``priority`` is on the protocol's scale: 1 first, up to ``PRIORITY_LEVELS``; 0 or None is
    ``DEFAULT_PRIORITY``."""
    settings = server_state(request).settings
    if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s <= 0):
        raise InvalidParameterError("the timeout must be a positive number")
    if priority is not None and not 0 <= priority <= settings.priority_levels:
        raise InvalidParameterError(
            f"priority must be between 0 (the default) and {settings.priority_levels}"
        )
    batcher = serving.batcher
    waited = time.perf_counter() - request_start_of(request.scope)
    deadline = batcher.now() + (timeout_s or settings.request_timeout_s) - waited
    level = (priority or settings.default_priority) - 1
    return Call(deadline, level)


def admit(request: Request, serving: Serving) -> Ticket:
    """An admission ticket for this request, or 503 ``overloaded`` before reading anything.

    A body declared larger than ``MAX_IMAGE_BYTES`` is admitted for that much only: it is
    refused with 413 as soon as it is read, since it would never fit however long it waited.
    """
    limit = server_state(request).settings.max_image_bytes
    try:
        return serving.admission.admit(min(declared_length(request), limit))
    except OverloadedError:
        server_state(request).metrics.on_reject("overloaded")
        raise


async def read_within(
    request: Request, ticket: Ticket, read: Callable[[Callable[[int], None]], Awaitable[Buffer]]
) -> Buffer:
    """Read the body with ``read(reserve)``, counting it against the ticket as it arrives."""
    try:
        return await read(ticket.reserve)
    except OverloadedError:  # the body outgrew what is left of MAX_QUEUE_BYTES
        server_state(request).metrics.on_reject("overloaded")
        raise


async def decode(request: Request, serving: Serving, data: Buffer) -> PreparedImage:
    """Sniff, check and (on the CPU) decode, resize and crop, in the decode threads."""
    loop = asyncio.get_running_loop()
    image = await loop.run_in_executor(serving.decode_pool, serving.engine.prepare, data)
    if image.pixels is not None:  # decoded here; a device decode is timed per batch
        server_state(request).metrics.observe_stage("decode", image.decode_s)
    return image


async def predict_all(
    request: Request,
    serving: Serving,
    items: Sequence[InferenceRequest],
    call: Call,
    ticket: Ticket,
) -> list[Prediction]:
    """Each item as its own batcher request (they may share batches with other clients'
    items); the results in order, or the first error, or ``ClientDisconnected``. The other
    items are withdrawn as soon as one fails or the client hangs up."""
    batcher = serving.batcher
    # The ticket hands its bytes to the batcher in one step (nothing is awaited in between),
    # so that admission never sees them counted twice or not at all.
    ticket.close()
    futures: list[asyncio.Future[Prediction]] = []
    try:
        for item in items:
            image = item.image
            cost = len(image.data) if image.data is not None else 0  # kept for the device
            futures.append(batcher.enqueue(item, call.deadline, cost=cost, priority=call.level))
        return await _gather_or_hang_up(futures, request.receive)
    finally:
        for future in futures:
            future.cancel()  # no-op for the finished ones; withdraws the rest


async def _gather_or_hang_up(
    futures: list[asyncio.Future[Prediction]], receive: Receive
) -> list[Prediction]:
    everything = asyncio.gather(*futures)
    disconnect = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((everything, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if everything.done():
        return everything.result()
    everything.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await everything
    raise ClientDisconnected


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

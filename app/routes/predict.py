"""``POST /predict``: one image in, its top-k classes out."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive

from app.admission import Ticket
from app.body import declared_length, read_image
from app.engine import InferenceRequest, Prediction
from app.errors import InvalidParameterError, OverloadedError, answer_error, mark_outcome
from app.requestid import request_start_of
from app.schemas import ErrorBody, PredictResponse
from app.state import ServerState, server_state
from batching import DynamicBatcher

router = APIRouter()

TIMEOUT_HEADER = "x-request-timeout-ms"
# No status is ever delivered to a client that hung up; 499 is what nginx logs for it.
CLIENT_CLOSED = 499

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (400, "invalid_image: the body is not a decodable image"),
        (401, "unauthorized: missing or wrong API key"),
        (413, "too_large: too many bytes or pixels"),
        (415, "unsupported_media_type: content type or image format not accepted"),
        (422, "invalid_parameter: bad top_k, timeout header, or multipart without 'file'"),
        (503, "overloaded (queue full in requests or bytes, with Retry-After) or not_ready"),
        (504, "deadline_exceeded: no result before the request's deadline"),
    )
}


class ClientDisconnected(Exception):
    """The client hung up while its request was waiting."""


@router.post(
    "/predict",
    response_model=PredictResponse,
    responses=_ERRORS,
    summary="Classify one image",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
                "image/png": {"schema": {"type": "string", "format": "binary"}},
                "image/webp": {"schema": {"type": "string", "format": "binary"}},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}},
                        "required": ["file"],
                    }
                },
            },
        }
    },
)
async def predict(
    request: Request,
    top_k: Annotated[int | None, Query(ge=1, description="classes to return")] = None,
) -> Response:
    """Send the image as the raw body (``Content-Type: image/*``) or as multipart field ``file``.

    ``X-Request-Timeout-Ms`` sets this request's deadline (default: the server's).
    """
    server = server_state(request)
    server.enter()
    try:
        return await _predict(server, request, top_k)
    except (ClientDisconnected, ClientDisconnect):  # while waiting, or while uploading
        mark_outcome(request.scope, "cancelled")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        elapsed = time.perf_counter() - request_start_of(request.scope)
        return answer_error(request, exc, {"Server-Timing": f"total;dur={elapsed * 1000:.3f}"})
    finally:
        server.leave()


async def _predict(server: ServerState, request: Request, top_k: int | None) -> Response:
    serving = server.require_ready()
    engine, batcher, metrics = serving.engine, serving.batcher, server.metrics
    settings = server.settings
    arrived = request_start_of(request.scope)
    k = settings.top_k if top_k is None else top_k
    if k > engine.num_classes:
        raise InvalidParameterError(f"top_k must be at most {engine.num_classes}")
    timeout_s = _timeout(request, settings.request_timeout_s)
    # The deadline counts from the request's arrival, on the batcher's clock.
    deadline = batcher.now() + timeout_s - (time.perf_counter() - arrived)

    # Admitted before the body is read: refused at once when the queue is full in requests or
    # in bytes (see app.admission), so memory stays bounded.
    parse_started = time.perf_counter()
    try:
        ticket = serving.admission.admit(declared_length(request))
    except OverloadedError:
        metrics.on_reject("overloaded")
        raise
    try:
        try:
            data = await read_image(request, settings.max_image_bytes, ticket.reserve)
        except OverloadedError:  # the body outgrew what is left of MAX_QUEUE_BYTES
            metrics.on_reject("overloaded")
            raise
        parsed = time.perf_counter()
        image = await asyncio.get_running_loop().run_in_executor(
            serving.decode_pool, engine.prepare, data
        )
        del data
        # Still encoded (for the device decoder): the bytes stay counted until dispatch.
        cost = len(image.data) if image.data is not None else 0
        metrics.observe_stage("parse", parsed - parse_started)
        if image.pixels is not None:  # decoded here; a device decode is timed per batch
            metrics.observe_stage("decode", image.decode_s)
        submitted = time.perf_counter()
        prediction = await _submit(
            batcher, InferenceRequest(image, k), deadline, cost, ticket, request.receive
        )
    finally:
        ticket.close()
    finished = time.perf_counter()
    body = orjson.dumps({"model": engine.name, "predictions": prediction.classes})
    serialized = time.perf_counter()
    metrics.observe_stage("serialize", serialized - finished)
    timing = {
        "parse": parsed - parse_started,
        "decode": image.decode_s,
        "queue": max(0.0, prediction.started - submitted),
        **prediction.timings,
        "serialize": serialized - finished,
        "total": serialized - arrived,
    }
    headers = {
        "Server-Timing": ", ".join(
            f"{name};dur={value * 1000:.3f}" for name, value in timing.items()
        ),
        "X-Batch-Size": str(prediction.batch_size),
    }
    mark_outcome(request.scope, "ok")
    return Response(body, media_type="application/json", headers=headers)


def _timeout(request: Request, default_s: float) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return default_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidParameterError("X-Request-Timeout-Ms must be a positive number of ms")
    return value / 1000


async def _submit(
    batcher: DynamicBatcher[InferenceRequest, Prediction],
    item: InferenceRequest,
    deadline: float,
    cost: int,
    ticket: Ticket,
    receive: Receive,
) -> Prediction:
    """Wait for the result, or withdraw the request as soon as the client hangs up."""

    async def enqueue() -> Prediction:
        # The ticket hands its bytes to the batcher in one step (nothing is awaited between
        # the two), so admission never sees them counted twice or not at all.
        ticket.close()
        return await batcher.submit(item, deadline, cost=cost)

    submit = asyncio.ensure_future(enqueue())
    disconnect = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((submit, disconnect), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        submit.cancel()
        raise
    finally:
        disconnect.cancel()
    if submit.done():
        return submit.result()
    submit.cancel()  # takes it out of the queue if it is still there
    with contextlib.suppress(asyncio.CancelledError):
        await submit
    raise ClientDisconnected


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

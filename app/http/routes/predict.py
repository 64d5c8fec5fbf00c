"""``POST /predict``: one image in, its top-k classes out."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.routing import APIRoute
from starlette.datastructures import QueryParams
from starlette.responses import Response

from app.errors import InvalidParameterError
from app.http import answers
from app.http.answers import wants_png
from app.http.auth import require_api_key
from app.http.body import declared_length, read_image
from app.http.calls import disconnected, guarded, mark_model
from app.http.errors import mark_outcome
from app.http.requestid import request_start_of
from app.http.schemas import ErrorBody, PredictResponse
from app.http.state import ServerState
from app.serving.inference import InferenceRequest, Inputs, ModelFacts, Parsed, Reserve
from preprocessing import Buffer


class PredictRoute(APIRoute):
    """Documented by FastAPI from ``predict``'s signature, but run without FastAPI's
    per-request solving of dependencies and parameters, which cost this route about 0.1 ms of
    the event loop per request on a small CPU (a sixth of its share of an image): the
    handler checks the key, reads the query parameters by the rules the signature declares,
    and calls ``predict``. So the router is included without dependencies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return handle


async def handle(request: Request, path_params: dict[str, str] | None = None) -> Response:
    """The whole route: the key, the query, the prediction (the direct dispatch's handler)."""
    await require_api_key(request)  # before any parameter is looked at
    query = request.query_params
    top_k, version = _at_least_one(query, "top_k"), _at_least_one(query, "version")
    limits = _score(query), _at_least_one(query, "max_detections")
    return await predict(request, top_k, query.get("model"), version, *limits,
                         masks=_flag(query, "masks"))  # fmt: skip


def _flag(query: QueryParams, name: str) -> bool:
    """A true-or-false parameter (true when absent), as FastAPI reads a ``bool``."""
    raw = query.get(name)
    if raw is None:
        return True
    value = raw.lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise InvalidParameterError(f"{name} must be true or false")


def _score(query: QueryParams) -> float | None:
    raw = query.get("min_score")
    if raw is None:
        return None
    value = _number(raw)
    if not 0 <= value <= 1:
        raise InvalidParameterError("min_score must be a number between 0 and 1")
    return value


def _number(raw: str) -> float:
    """``raw`` as a float; NaN (which every range check refuses) when it is not a number."""
    try:
        return float(raw)
    except ValueError:
        return math.nan


def _at_least_one(query: QueryParams, name: str) -> int | None:
    raw = query.get(name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise InvalidParameterError(f"{name} must be a whole number of at least 1")
    return int(raw)


router = APIRouter(route_class=PredictRoute)

TIMEOUT_HEADER = "x-request-timeout-ms"
PRIORITY_HEADER = "x-priority"

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (400, "invalid_image: the body is not a decodable image"),
        (401, "unauthorized: missing or wrong API key"),
        (413, "too_large: too many bytes or pixels"),
        (415, "unsupported_media_type: content type or image format not accepted"),
        (404, "not_found: no such model, or no such version of it"),
        (422, "invalid_parameter: bad top_k, timeout or priority header, multipart without 'file'"),
        (503, "overloaded (queue full in requests or bytes, with Retry-After) or not_ready"),
        (504, "deadline_exceeded: no result before the request's deadline"),
    )
}


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
    model: Annotated[
        str | None, Query(description="the model (default: DEFAULT_MODEL, or the only one)")
    ] = None,
    version: Annotated[
        int | None, Query(ge=1, description="its version (default: the highest serving)")
    ] = None,
    min_score: Annotated[
        float | None, Query(ge=0, le=1, description="a detector's lowest score answered")
    ] = None,
    max_detections: Annotated[
        int | None, Query(ge=1, description="the most boxes a detector answers")
    ] = None,
    masks: Annotated[
        bool, Query(description="an instance segmenter's masks with its boxes (false: boxes)")
    ] = True,
) -> Response:
    """Send the image as the raw body (``Content-Type: image/*``) or as multipart field ``file``.

    The answer follows the model's task: its top classes, its boxes (in the image's pixels;
    with each box's mask as COCO run-length, unless ``masks=false``, and its keypoints, where
    the model gives them), its mask (``Accept: image/png``: the mask as a PNG of class
    indices) or its embedding.
    ``X-Request-Timeout-Ms`` sets this request's deadline (default: the model's);
    ``X-Priority`` its priority (1 first, up to ``PRIORITY_LEVELS``; 0: the default).
    """
    return await guarded(request, lambda server: _predict(
        server, request, top_k, model, version, min_score, max_detections, masks
    ))  # fmt: skip


async def _predict(
    server: ServerState,
    request: Request,
    top_k: int | None,
    model: str | None,
    version: int | None,
    min_score: float | None = None,
    max_detections: int | None = None,
    masks: bool = True,
) -> Response:
    predictor = server.require_ready()
    answer = await predictor.infer(InferenceRequest(
        model=model, version=version, body=ImageBody(request), parse=one_image,
        parse_off_loop=False, declared_bytes=declared_length(request),
        timeout_s=_timeout(request), priority=_priority(request), top_k=top_k,
        min_score=min_score, max_detections=max_detections, masks=masks,
        cancelled=lambda: disconnected(request.receive),
        named=lambda name: mark_model(request.scope, name),
        arrived=request_start_of(request.scope),
    ))  # fmt: skip
    finished = time.perf_counter()
    (prediction,) = answer.predictions
    png = wants_png(request.headers.get("accept"))
    if answer.task == "segment":  # a PNG to encode: in a thread, not on the event loop
        content, media_type = await predictor.parsing.run(0, answers.body, answer,
                                                          prediction, png)  # fmt: skip
    else:
        content, media_type = answers.body(answer, prediction, png)
    serialized = time.perf_counter()
    answer.observe_stage("serialize", serialized - finished)
    timing = {**answer.timings, "serialize": serialized - finished,
              "total": serialized - request_start_of(request.scope)}  # fmt: skip
    headers = {
        "Server-Timing": ", ".join(
            f"{name};dur={value * 1000:.3f}" for name, value in timing.items()
        ),
        "X-Batch-Size": str(prediction.batch_size),
    }
    mark_outcome(request.scope, "ok")
    return Response(content, media_type=media_type, headers=headers)


def one_image(data: Buffer, facts: ModelFacts) -> Parsed:
    """The body is the image (a raw body, or a multipart form's ``file``)."""
    return Parsed(Inputs("encoded", [data]))


class ImageBody:
    """The request's image: a raw body, or a multipart form's ``file``."""

    def __init__(self, request: Request) -> None:
        self._request = request

    async def read(self, reserve: Reserve, limit: int) -> Buffer:
        return await read_image(self._request, limit, reserve)


def _timeout(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    value = _number(raw)
    if not math.isfinite(value) or value <= 0:
        raise InvalidParameterError("X-Request-Timeout-Ms must be a positive number of ms")
    return value / 1000


def _priority(request: Request) -> int | None:
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidParameterError("X-Priority must be an integer") from None

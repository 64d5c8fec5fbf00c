"""The Open Inference Protocol (KServe v2 / Triton REST) over HTTP.

Every model of the server and each of its versions (``/v2/models/{name}[/versions/{v}]``).
A model takes exactly one of three inputs:

- ``image``, BYTES ``[N]``: encoded images (binary extension, or base64 strings in JSON);
- ``pixels``, UINT8 ``[N, H, W, 3]``: decoded RGB images, resized and cropped here;
- ``tensor``, FP32 ``[N, 3, crop, crop]``: the model's input, normalised by the client;

and gives ``probabilities``, FP32 ``[N, classes]``, or, with Triton's classification
extension (``"classification": k`` on the output), BYTES ``[N, k]`` of ``"score:index:label"``.
Each of the N images is its own batcher item. Priority (1 first) and timeout (microseconds)
come from the request's parameters.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.engine import InferenceEngine, Prediction
from app.errors import NotReadyError
from app.http.auth import require_api_key
from app.http.body import read_raw
from app.http.calls import admit, disconnected, guarded, read_within
from app.http.errors import mark_outcome
from app.http.requestid import request_start_of
from app.http.responses import json_response
from app.http.state import ServerState, server_state
from app.protocol.model_io import (
    EXTENSIONS,
    OUTPUT,
    RequestedOutput,
    classification,
    dense,
    metadata,
    one_input,
    requested_output,
    schedule_parameter,
    top_k_for,
    wants_dense,
)
from app.protocol.tensors import (
    InferenceRequestBody,
    output_entry,
    parse_request,
    read_inputs,
)
from app.serving.predict import Inputs
from app.serving.version import ModelVersion
from preprocessing import Buffer

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])
health = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])

HEADER_LENGTH = "inference-header-content-length"


def _resolve(server: ServerState, name: str, version: str | None) -> ModelVersion:
    return server.started().registry.resolve(name, version)


def _live(request: Request) -> Response:
    live = server_state(request).lifecycle.live
    return json_response({"live": live}, status_code=200 if live else 503)


@health.get("/health/live", summary="Server live (the process can serve, now or soon)")
async def server_live(request: Request) -> Response:
    return _live(request)


@health.get("/health/ready", summary="Server ready (the model is loaded and serving)")
async def server_ready(request: Request) -> Response:
    ready = server_state(request).lifecycle.ready
    return json_response({"ready": ready}, status_code=200 if ready else 503)


@health.get("/models/{name}/ready", summary="Model ready")
@health.get("/models/{name}/versions/{version}/ready", summary="Model version ready")
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    server = server_state(request)
    try:
        ready = _resolve(server, name, version).ready and server.lifecycle.ready
    except NotReadyError:
        ready = False
    return json_response({"name": name, "ready": ready}, status_code=200 if ready else 503)


@router.get("", summary="Server metadata")
async def server_metadata(request: Request) -> Response:
    return json_response({"name": "batchserve", "version": request.app.version,
                          "extensions": EXTENSIONS})  # fmt: skip


@router.get("/models/{name}", summary="Model metadata")
@router.get("/models/{name}/versions/{version}", summary="Model version metadata")
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    server = server_state(request)
    serving = _resolve(server, name, version)
    engine = serving.engine
    if engine is None:
        raise NotReadyError(f"{serving.name} is {serving.reason}", headers={"Retry-After": "1"})
    versions = server.started().registry.models.get(name, {})
    return json_response({
        "name": name,
        "versions": [str(number) for number in sorted(versions)],
        **metadata(engine),
    })  # fmt: skip


_INFER_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/models/{name}/infer", summary="Inference", openapi_extra=_INFER_DOC)
@router.post("/models/{name}/versions/{version}/infer", summary="Inference (a version)",
             openapi_extra=_INFER_DOC)  # fmt: skip
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    """An Open Inference Protocol request: JSON, or JSON followed by binary tensor data with
    ``Inference-Header-Content-Length``; any ``Content-Type`` (Triton's client sends none)."""
    return await guarded(request, lambda server: _infer(server, request, name, version))


async def handle_infer(request: Request, path_params: dict[str, str]) -> Response:
    """``infer`` with its key check, for the direct dispatch (FastAPI's router adds the check as
    a dependency)."""
    await require_api_key(request)
    return await infer(request, path_params["name"], path_params.get("version"))


async def _infer(server: ServerState, request: Request, name: str, version: str | None) -> Response:
    predictor = server.require_ready()
    settings = server.settings
    arrived = request_start_of(request.scope)
    admitted = admit(request, predictor, name, version)
    try:
        serving = admitted.version
        body = await read_within(
            predictor, admitted,
            lambda reserve: read_raw(request, settings.max_image_bytes, reserve),
        )  # fmt: skip
        header_length = request.headers.get(HEADER_LENGTH)

        def parse(raw: Buffer) -> tuple[InferenceRequestBody, Inputs]:
            # JSON, validation, base64 and flattening of a body of up to MAX_IMAGE_BYTES take
            # long enough to stall every other request and the probes: not on the event loop.
            document, binary = parse_request(bytes(raw), header_length)
            tensors = read_inputs(document, binary, settings.images_per_request,
                                  settings.max_image_bytes)  # fmt: skip
            return document, one_input(tensors)

        document, inputs = await predictor.parsing.run(
            admitted.version.config.default_priority - 1, parse, body
        )
        del body
        timeout, priority = _schedule(document)
        deadline = predictor.deadline(admitted, timeout, arrived)
        level = predictor.priority_level(admitted, priority)
        outputs = _requested_outputs(document, admitted.engine)
        request_id = document.id
        # From here on only the decoded images wait (counted by the batcher as they are): the
        # document (a JSON tensor is millions of Python numbers) and the raw input go now.
        del document
        images = await predictor.prepare(admitted, inputs, level)
        del inputs
        predictions = await predictor.predict(
            admitted, images, top_k_for(outputs), deadline, level,
            lambda: disconnected(request.receive), dense=wants_dense(outputs),
        )  # fmt: skip
        engine = admitted.engine
    finally:
        admitted.close()
    started = time.perf_counter()
    response = _response(request_id, serving, engine, outputs, predictions)
    serving.metrics.observe_stage("serialize", time.perf_counter() - started)
    mark_outcome(request.scope, "ok")
    return response


def _schedule(document: InferenceRequestBody) -> tuple[float | None, int | None]:
    """The request's ``timeout`` (microseconds, as seconds) and ``priority`` parameters."""
    parameters = document.parameters
    timeout = schedule_parameter("timeout", parameters.get("timeout"))
    priority = schedule_parameter("priority", parameters.get("priority"))
    return (None if timeout is None else timeout / 1e6), priority


def _requested_outputs(
    document: InferenceRequestBody, engine: InferenceEngine
) -> list[RequestedOutput]:
    binary_all = bool(document.parameters.get("binary_data_output", False))
    requested = document.outputs or []
    if not requested:
        return [RequestedOutput(None, binary_all)]
    return [
        RequestedOutput(
            requested_output(
                output.name, output.parameters.get("classification"), engine.num_classes
            ),
            bool(output.parameters.get("binary_data", binary_all)),
        )
        for output in requested
    ]


def _response(
    request_id: str | None,
    serving: ModelVersion,
    engine: InferenceEngine,
    outputs: list[RequestedOutput],
    predictions: list[Prediction],
) -> Response:
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    rows = len(predictions)
    for output in outputs:
        if output.classification is None:
            classes = engine.num_classes
            item, raw = output_entry(OUTPUT, dense(predictions, classes), [rows, classes],
                                     output.binary)  # fmt: skip
        else:
            count = output.classification
            item, raw = output_entry(OUTPUT, classification(predictions, count), [rows, count],
                                     output.binary)  # fmt: skip
        entries.append(item)
        chunks.append(raw)
    payload: dict[str, Any] = {
        "model_name": serving.model,
        "model_version": str(serving.version),
        "outputs": entries,
    }
    if request_id is not None:
        payload["id"] = request_id
    header = orjson.dumps(payload)
    tensors = b"".join(chunks)
    if not tensors:
        return Response(header, media_type="application/json")
    return Response(
        header + tensors,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )

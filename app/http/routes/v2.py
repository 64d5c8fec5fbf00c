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

from app.errors import NotReadyError
from app.http.auth import require_api_key
from app.http.body import declared_length, read_raw
from app.http.calls import disconnected, guarded, mark_model
from app.http.errors import mark_outcome
from app.http.requestid import request_start_of
from app.http.responses import json_response
from app.http.state import ServerState, server_state
from app.protocol.model_io import (
    EXTENSIONS,
    RequestedOutput,
    detection_parameter,
    metadata,
    one_input,
    render,
    requested_outputs,
    schedule_parameter,
    top_k_for,
    wants_dense,
    wants_masks,
)
from app.protocol.tensors import (
    InferenceRequestBody,
    output_entry,
    parse_request,
    read_inputs,
)
from app.serving.inference import InferenceRequest, InferenceResponse, ModelFacts, Parsed, Reserve
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
    return json_response(metadata(server_state(request).started().describe(name, version)))


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
    header_length = request.headers.get(HEADER_LENGTH)

    def parse(raw: Buffer, facts: ModelFacts) -> Parsed:
        # JSON, validation, base64 and flattening of a body of up to MAX_IMAGE_BYTES take
        # long enough to stall every other request and the probes: in the parse threads.
        document, binary = parse_request(bytes(raw), header_length)
        tensors = read_inputs(document, binary, facts.max_images, facts.max_bytes)
        outputs = _requested_outputs(document, facts.classes, facts.task, facts.instances)
        parameters = document.parameters
        timeout = schedule_parameter("timeout", parameters.get("timeout"))
        return Parsed(
            one_input(tensors), top_k=top_k_for(outputs), dense=wants_dense(outputs),
            timeout_s=None if timeout is None else timeout / 1e6,
            priority=schedule_parameter("priority", parameters.get("priority")),
            min_score=detection_parameter("min_score", parameters.get("min_score")),
            max_detections=detection_parameter("max_detections",
                                               parameters.get("max_detections")),
            masks=wants_masks(outputs), detail=(document.id, outputs),
        )  # fmt: skip

    answer = await predictor.infer(InferenceRequest(
        model=name, version=version, body=RawBody(request),
        parse=parse, declared_bytes=declared_length(request),
        cancelled=lambda: disconnected(request.receive),
        named=lambda model: mark_model(request.scope, model),
        arrived=request_start_of(request.scope),
    ))  # fmt: skip
    started = time.perf_counter()
    request_id, outputs = answer.detail
    response = _response(request_id, answer, outputs)
    answer.observe_stage("serialize", time.perf_counter() - started)
    mark_outcome(request.scope, "ok")
    return response


class RawBody:
    """The whole body, whatever its content type."""

    def __init__(self, request: Request) -> None:
        self._request = request

    async def read(self, reserve: Reserve, limit: int) -> Buffer:
        return await read_raw(self._request, limit, reserve)


def _requested_outputs(
    document: InferenceRequestBody, classes: int, task: str, instances: tuple[str, ...]
) -> list[RequestedOutput]:
    binary_all = bool(document.parameters.get("binary_data_output", False))
    asked = [
        (output.name, output.parameters.get("classification"),
         bool(output.parameters.get("binary_data", binary_all)))
        for output in document.outputs or []
    ]  # fmt: skip
    return requested_outputs(task, asked, classes, binary_all, instances)


def _response(
    request_id: str | None, answer: InferenceResponse, outputs: list[RequestedOutput]
) -> Response:
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    predictions = answer.predictions
    for output in outputs:
        tensor = render(output, predictions, answer.classes, answer.task)
        item, raw = output_entry(tensor, output.binary)
        entries.append(item)
        chunks.append(raw)
    payload: dict[str, Any] = {
        "model_name": answer.model,
        "model_version": answer.version,
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

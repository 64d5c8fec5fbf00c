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

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.engine import InferenceEngine, Prediction
from app.errors import InvalidParameterError, NotReadyError
from app.http.body import read_raw
from app.http.calls import admit, disconnected, guarded, read_within
from app.http.errors import mark_outcome
from app.http.requestid import request_start_of
from app.http.responses import json_response
from app.http.state import ServerState, server_state
from app.protocol.tensors import (
    InferenceRequestBody,
    MalformedTensorError,
    Tensor,
    output_entry,
    parse_request,
    read_inputs,
)
from app.serving.predict import Inputs
from app.serving.version import ModelVersion

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])
health = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])

OUTPUT = "probabilities"
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]
PLATFORMS = {"torch": "pytorch_libtorch", "onnxruntime": "onnxruntime_onnx",
             "openvino": "openvino"}  # fmt: skip
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
    crop = engine.transform.crop_size
    versions = server.started().registry.models.get(name, {})
    return json_response({
        "name": name,
        "versions": [str(number) for number in sorted(versions)],
        "platform": PLATFORMS.get(engine.backend.name, engine.backend.name),
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [-1]},
            {"name": "pixels", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
            {"name": "tensor", "datatype": "FP32", "shape": [-1, 3, crop, crop]},
        ],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, engine.num_classes]}],
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
        document, binary = parse_request(bytes(body), request.headers.get(HEADER_LENGTH))
        del body
        timeout, priority = _schedule(document)
        deadline = predictor.deadline(admitted, timeout, arrived)
        level = predictor.priority_level(admitted, priority)
        (tensor,) = _one_input(read_inputs(document, binary))
        del binary
        outputs = _requested_outputs(document, admitted.engine)
        images = await predictor.prepare(admitted, _inputs(tensor))
        k = max((count or admitted.engine.num_classes) for _, count, _ in outputs)
        predictions = await predictor.predict(
            admitted, images, k, deadline, level, lambda: disconnected(request.receive)
        )
        engine = admitted.engine
    finally:
        admitted.close()
    started = time.perf_counter()
    response = _response(document, serving, engine, outputs, predictions)
    serving.metrics.observe_stage("serialize", time.perf_counter() - started)
    mark_outcome(request.scope, "ok")
    return response


def _schedule(document: InferenceRequestBody) -> tuple[float | None, int | None]:
    """The request's ``timeout`` (microseconds, as seconds) and ``priority`` parameters."""
    parameters = document.parameters
    timeout, priority = parameters.get("timeout"), parameters.get("priority")
    for key, value in (("timeout", timeout), ("priority", priority)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidParameterError(f"the {key} parameter must be an integer")
    return (None if not timeout else timeout / 1e6), priority


def _one_input(tensors: list[Tensor]) -> list[Tensor]:
    if len(tensors) != 1:
        raise MalformedTensorError("send exactly one input: image, pixels or tensor")
    return tensors


def _requested_outputs(
    document: InferenceRequestBody, engine: InferenceEngine
) -> list[tuple[str, int | None, bool]]:
    """(name, classification count or None, binary) per requested output."""
    binary_all = document.parameters.get("binary_data_output", False)
    requested = document.outputs or []
    if not requested:
        return [(OUTPUT, None, bool(binary_all))]
    outputs = []
    for output in requested:
        if output.name != OUTPUT:
            raise InvalidParameterError(f"unknown output {output.name!r}; the output is {OUTPUT!r}")
        count = output.parameters.get("classification")
        if count is not None and (
            not isinstance(count, int) or isinstance(count, bool)
            or not 1 <= count <= engine.num_classes
        ):  # fmt: skip
            raise InvalidParameterError(
                f"classification must be an integer from 1 to {engine.num_classes}"
            )
        binary = output.parameters.get("binary_data", binary_all)
        outputs.append((OUTPUT, count, bool(binary)))
    return outputs


def _inputs(tensor: Tensor) -> Inputs:
    """The protocol's three inputs, as the serving core takes them."""
    if tensor.name == "image" and tensor.datatype == "BYTES":
        if len(tensor.shape) not in (1, 2) or tensor.shape[1:] not in ((), (1,)):
            raise MalformedTensorError("input 'image' must have shape [N] (or [N, 1])")
        return Inputs("encoded", tensor.items or [])
    if tensor.name == "pixels" and tensor.datatype == "UINT8" and tensor.array is not None:
        if tensor.array.ndim != 4 or tensor.array.shape[3] != 3:
            raise MalformedTensorError("input 'pixels' must have shape [N, H, W, 3]")
        return Inputs("pixels", tensor.array)
    if tensor.name == "tensor" and tensor.datatype == "FP32" and tensor.array is not None:
        return Inputs("tensor", tensor.array)
    raise MalformedTensorError(
        f"unknown input {tensor.name!r} of {tensor.datatype}: send image (BYTES), pixels "
        f"(UINT8) or tensor (FP32)"
    )


def _response(
    document: InferenceRequestBody,
    serving: ModelVersion,
    engine: InferenceEngine,
    outputs: list[tuple[str, int | None, bool]],
    predictions: list[Prediction],
) -> Response:
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    classes = engine.num_classes
    for output, count, binary in outputs:
        if count is None:
            dense = np.zeros((len(predictions), classes), dtype=np.float32)
            for row, prediction in enumerate(predictions):
                for entry in prediction.classes:
                    dense[row, entry["index"]] = entry["score"]
            item, raw = output_entry(output, dense, [len(predictions), classes], binary)
        else:
            labels = [
                f"{entry['score']:f}:{entry['index']}:{entry['label']}"
                for prediction in predictions for entry in prediction.classes[:count]
            ]  # fmt: skip
            item, raw = output_entry(output, labels, [len(predictions), count], binary)
        entries.append(item)
        chunks.append(raw)
    payload: dict[str, Any] = {
        "model_name": serving.model,
        "model_version": str(serving.version),
        "outputs": entries,
    }
    if document.id is not None:
        payload["id"] = document.id
    header = orjson.dumps(payload)
    tensors = b"".join(chunks)
    if not tensors:
        return Response(header, media_type="application/json")
    return Response(
        header + tensors,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )

"""What a model takes and gives in the Open Inference Protocol, whatever the transport.

A request carries exactly one input, ``image`` (BYTES ``[N]``: encoded images), ``pixels``
(UINT8 ``[N, H, W, 3]``) or ``tensor`` (FP32 ``[N, 3, crop, crop]``, normalised), and asks for
``probabilities``: FP32 ``[N, classes]``, or with the classification extension
(``classification: k``) BYTES ``[N, k]`` of ``"score:index:label"``, best first. REST and gRPC
both read and write through here, so that they answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from app.errors import InvalidParameterError
from app.protocol.tensors import MalformedTensorError, Tensor
from app.serving.inference import Inputs, ModelDescription, Prediction

OUTPUT = "probabilities"
# What the server metadata names: the extensions of the protocol served (REST and gRPC alike).
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]
PLATFORMS = {"torch": "pytorch_libtorch", "onnxruntime": "onnxruntime_onnx",
             "openvino": "openvino"}  # fmt: skip


@dataclass(frozen=True)
class RequestedOutput:
    """``probabilities``, dense (``classification`` None) or its top ``classification``."""

    classification: int | None
    binary: bool = True


def metadata(model: ModelDescription) -> dict[str, Any]:
    """Name, versions, platform, inputs and outputs of a model (its datatypes and shapes, -1
    for the batch)."""
    crop = model.crop_size
    return {
        "name": model.name,
        "versions": model.versions,
        "platform": PLATFORMS.get(model.backend, model.backend),
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [-1]},
            {"name": "pixels", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
            {"name": "tensor", "datatype": "FP32", "shape": [-1, 3, crop, crop]},
        ],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, model.classes]}],
    }


def one_input(tensors: list[Tensor]) -> Inputs:
    """The request's one input, as the serving core takes it."""
    if len(tensors) != 1:
        raise MalformedTensorError("send exactly one input: image, pixels or tensor")
    (tensor,) = tensors
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


def requested_output(name: str, classification: Any, classes: int) -> int | None:
    """Check one requested output; its classification count (None: dense probabilities)."""
    if name != OUTPUT:
        raise InvalidParameterError(f"unknown output {name!r}; the output is {OUTPUT!r}")
    if classification is None:
        return None
    if (not isinstance(classification, int) or isinstance(classification, bool)
            or not 1 <= classification <= classes):  # fmt: skip
        raise InvalidParameterError(f"classification must be an integer from 1 to {classes}")
    return classification


def schedule_parameter(name: str, value: Any) -> int | None:
    """The ``priority`` or ``timeout`` parameter, an integer (None when absent or 0)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameterError(f"the {name} parameter must be an integer")
    return value or None


def top_k_for(outputs: list[RequestedOutput]) -> int:
    """How many classes the engine must rank for these outputs' classification."""
    return max((output.classification or 1) for output in outputs)


def wants_dense(outputs: list[RequestedOutput]) -> bool:
    """Whether an output asks for every class's probability."""
    return any(output.classification is None for output in outputs)


def dense(predictions: list[Prediction], classes: int) -> np.ndarray[Any, Any]:
    """FP32 ``[N, classes]``: each prediction's probabilities (or its ranked classes)."""
    values = np.zeros((len(predictions), classes), dtype=np.float32)
    for row, prediction in enumerate(predictions):
        if prediction.probabilities is not None:
            values[row] = prediction.probabilities
            continue
        for entry in prediction.classes:
            values[row, entry["index"]] = entry["score"]
    return values


def classification(predictions: list[Prediction], count: int) -> list[str]:
    """``"score:index:label"`` of each prediction's ``count`` best classes, row-major."""
    return [
        f"{entry['score']:f}:{entry['index']}:{entry['label']}"
        for prediction in predictions
        for entry in prediction.classes[:count]
    ]

"""What a model takes and gives in the Open Inference Protocol, whatever the transport.

A request carries exactly one input, ``image`` (BYTES ``[N]``: encoded images), ``pixels``
(UINT8 ``[N, H, W, 3]``) or ``tensor`` (FP32 ``[N, 3, H, W]``, the model's own input: resized,
padded and normalised as the model's transform does it, answered in its own pixels), and asks
for its model's outputs (all of them when it names none):

- a classifier: ``probabilities``, FP32 ``[N, classes]``, or with the classification extension
  (``classification: k``) BYTES ``[N, k]`` of ``"score:index:label"``, best first;
- a detector: ``boxes`` FP32 ``[N, K, 4]`` (x1, y1, x2, y2 in each image's pixels), ``scores``
  FP32 ``[N, K]``, ``labels`` INT64 ``[N, K]`` and ``num_detections`` INT32 ``[N]``, padded to
  the largest K of the request with zeros (the convention of TensorRT's NMS plugins); an
  instance segmenter's ``masks`` too, BYTES ``[N, K]``, each box's mask in its image's pixels
  as COCO run-length in JSON (``{"size": [h, w], "counts": "..."}``, what pycocotools
  writes; an empty string pads), and a keypoint detector's ``keypoints``, FP32
  ``[N, K, P, 3]`` (x, y in the image's pixels, and each keypoint's score);
- a segmenter: ``mask``, UINT8 (UINT16 past 256 classes) ``[N, H, W]`` of class indices, when
  every image of the request has the same size;
- an encoder: ``embedding``, FP32 ``[N, D]``.

REST and gRPC both read and write through here, so that they answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from app.errors import BadRequestError, InvalidParameterError
from app.protocol.tensors import MalformedTensorError, OutputTensor, Tensor
from app.serving.inference import Inputs, ModelDescription, Prediction

OUTPUT = "probabilities"
# What the server metadata names: the extensions of the protocol served (REST and gRPC alike).
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]
PLATFORMS = {"torch": "pytorch_libtorch", "onnxruntime": "onnxruntime_onnx",
             "openvino": "openvino"}  # fmt: skip


# Each task's outputs, in the order they are answered when a request names none.
TASK_OUTPUTS = {
    "classify": (OUTPUT,),
    "detect": ("boxes", "scores", "labels", "num_detections"),
    "segment": ("mask",),
    "embed": ("embedding",),
}


@dataclass(frozen=True)
class RequestedOutput:
    """One output asked for; a classifier's ``probabilities`` dense (``classification``
    None) or its top ``classification``."""

    classification: int | None
    binary: bool = True
    name: str = OUTPUT


def outputs_of(task: str, instances: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A model's outputs: its task's, and a detector's ``masks`` and ``keypoints``."""
    return TASK_OUTPUTS[task] + tuple(instances)


def metadata(model: ModelDescription) -> dict[str, Any]:
    """Name, versions, platform, inputs and outputs of a model (its datatypes and shapes, -1
    for the batch and for what varies)."""
    height, width = model.canvas or (-1, -1)
    return {
        "name": model.name,
        "versions": model.versions,
        "platform": PLATFORMS.get(model.backend, model.backend),
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [-1]},
            {"name": "pixels", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
            {"name": "tensor", "datatype": "FP32", "shape": [-1, 3, height, width]},
        ],
        "outputs": _described_outputs(model),
    }


def _described_outputs(model: ModelDescription) -> list[dict[str, Any]]:
    if model.task == "detect":
        instances = {
            "masks": {"name": "masks", "datatype": "BYTES", "shape": [-1, -1]},
            "keypoints": {"name": "keypoints", "datatype": "FP32", "shape": [-1, -1, -1, 3]},
        }
        return [
            {"name": "boxes", "datatype": "FP32", "shape": [-1, -1, 4]},
            {"name": "scores", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "labels", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "num_detections", "datatype": "INT32", "shape": [-1]},
        ] + [instances[name] for name in model.instances]
    if model.task == "segment":
        datatype = "UINT8" if model.classes <= 256 else "UINT16"
        return [{"name": "mask", "datatype": datatype, "shape": [-1, -1, -1]}]
    if model.task == "embed":
        return [{"name": "embedding", "datatype": "FP32", "shape": [-1, model.dimensions]}]
    return [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, model.classes]}]


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


def requested_outputs(
    task: str,
    asked: list[tuple[str, Any, bool]],
    classes: int,
    binary: bool = True,
    instances: tuple[str, ...] = (),
) -> list[RequestedOutput]:
    """The outputs a request asks for, each ``(name, classification, binary)``, checked
    against its model's outputs; every output of the model when it asks for none."""
    if not asked:
        return [RequestedOutput(None, binary, name) for name in outputs_of(task, instances)]
    return [
        RequestedOutput(
            requested_output(name, classification, classes, task, instances), each, name
        )
        for name, classification, each in asked
    ]


def wants_masks(outputs: list[RequestedOutput]) -> bool:
    """Whether an instance segmenter's masks are asked for (they cost the most to make)."""
    return any(output.name == "masks" for output in outputs)


def requested_output(
    name: str,
    classification: Any,
    classes: int,
    task: str = "classify",
    instances: tuple[str, ...] = (),
) -> int | None:
    """Check one requested output; its classification count (None: dense probabilities)."""
    known = outputs_of(task, instances)
    if name not in known:
        raise InvalidParameterError(f"unknown output {name!r}; the outputs are {', '.join(known)}")
    if classification is None:
        return None
    if task != "classify":
        raise InvalidParameterError("the classification extension is for classifiers only")
    if (not isinstance(classification, int) or isinstance(classification, bool)
            or not 1 <= classification <= classes):  # fmt: skip
        raise InvalidParameterError(f"classification must be an integer from 1 to {classes}")
    return classification


def detection_parameter(name: str, value: Any) -> Any:
    """``min_score`` (a number) or ``max_detections`` (an integer), or None when absent."""
    if value is None:
        return None
    integer = name == "max_detections"
    valid = isinstance(value, int) if integer else isinstance(value, int | float)
    if not valid or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise InvalidParameterError(f"the {name} parameter must be {kind}")
    return value


def schedule_parameter(name: str, value: Any) -> int | None:
    """The ``priority`` or ``timeout`` parameter, an integer (None when absent or 0)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameterError(f"the {name} parameter must be an integer")
    return value or None


def render(
    output: RequestedOutput, predictions: list[Prediction], classes: int, task: str
) -> OutputTensor:
    """One requested output of a request's predictions."""
    rows = len(predictions)
    name = output.name
    if task == "detect":
        return _detections(name, predictions)
    if task == "segment":
        masks = [prediction.mask for prediction in predictions]
        if len({mask.shape for mask in masks if mask is not None}) != 1:
            raise BadRequestError(
                "the images of this request have different sizes, and a mask output is one "
                "tensor: send one image per request"
            )
        stacked = np.stack([mask for mask in masks if mask is not None])
        datatype = "UINT8" if stacked.dtype == np.uint8 else "UINT16"
        return OutputTensor(name, datatype, list(stacked.shape), stacked)
    if task == "embed":
        vectors = np.stack([p.embedding for p in predictions if p.embedding is not None])
        return OutputTensor(name, "FP32", list(vectors.shape), vectors.astype(np.float32))
    if output.classification is None:
        return OutputTensor(name, "FP32", [rows, classes], dense(predictions, classes))
    count = output.classification
    return OutputTensor(name, "BYTES", [rows, count], classification(predictions, count))


def _detections(name: str, predictions: list[Prediction]) -> OutputTensor:
    found = [prediction.detected for prediction in predictions]
    counts = np.array([len(each) if each is not None else 0 for each in found], dtype=np.int32)
    if name == "num_detections":
        return OutputTensor(name, "INT32", [len(found)], counts)
    width = int(counts.max(initial=0))
    if name == "masks":
        strings = [""] * (len(found) * width)
        for row, each in enumerate(found):
            for column, mask in enumerate((each.masks or []) if each is not None else []):
                strings[row * width + column] = orjson.dumps(mask).decode()
        return OutputTensor(name, "BYTES", [len(found), width], strings)
    if name == "keypoints":
        points = max((each.keypoints.shape[1] for each in found
                      if each is not None and each.keypoints is not None), default=0)  # fmt: skip
        values = np.zeros((len(found), width, points, 3), dtype=np.float32)
        for row, each in enumerate(found):
            if each is not None and each.keypoints is not None and len(each):
                values[row, : len(each)] = each.keypoints
        return OutputTensor(name, "FP32", list(values.shape), values)
    shape = [len(found), width, 4] if name == "boxes" else [len(found), width]
    values = np.zeros(shape, dtype=np.int64 if name == "labels" else np.float32)
    for row, each in enumerate(found):
        if each is not None and len(each):
            values[row, : len(each)] = getattr(each, name)
    return OutputTensor(name, "INT64" if name == "labels" else "FP32", shape, values)


def top_k_for(outputs: list[RequestedOutput]) -> int:
    """How many classes the engine must rank for these outputs' classification."""
    return max((output.classification or 1) for output in outputs)


def wants_dense(outputs: list[RequestedOutput]) -> bool:
    """Whether an output asks for every class's probability."""
    return any(output.classification is None and output.name == OUTPUT for output in outputs)


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

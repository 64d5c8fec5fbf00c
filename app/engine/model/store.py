"""Where a model's artefacts are, and making the ones that are not there yet: the fp32 ONNX
export, the OpenVINO IR converted from it, the TorchScript model, and where an INT8 model of
each runtime lives. Each is named by everything that changes its contents (``ArtifactKey``):
the model, its weights' digest, the input size, the precision and the exporter."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from app.engine.backends.base import Decode
from app.engine.device import NAMES
from app.engine.errors import StartupError
from app.engine.model.artifacts import ArtifactKey, building, find
from app.engine.model.export import (
    ONNX_FILE,
    OPENVINO_FILE,
    OUTPUT_NAME,
    convert_to_openvino,
    export_graph,
    export_onnx,
    onnx_exporter,
    openvino_exporter,
)
from app.engine.model.loading import LoadedModel, loaded_digest
from app.engine.tasks.adapters import DetectorDecoding, DetectorParts, detector_parts
from app.engine.tasks.rcnn import BOX_HEAD_INPUTS, BOX_HEAD_OUTPUTS, RcnnDecode

logger = logging.getLogger("batchserve")

QDQ = "-qdq"  # INT8 ONNX artefacts: static quantisation with QuantizeLinear/DequantizeLinear
NNCF = "-nncf"  # INT8 OpenVINO artefacts: NNCF's post-training quantization of the fp32 IR
BOX_HEAD = "-box-head-pooled"  # a two-stage detector's box head, its runtime's second graph


def input_shape(loaded: LoadedModel) -> tuple[int, int, int]:
    """One image's input for a 640 x 480 photo: what the model is exported and probed at."""
    return (3, *loaded.transform.example_canvas)


def any_canvas(loaded: LoadedModel) -> bool:
    """Whether the model's canvas follows each image's size (its export takes any height and
    width, in multiples of its ``size_divisible``)."""
    return not loaded.transform.fit.fixed_canvas


def torchscript_artifact(
    root: Path, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> Path:
    """Where the traced and frozen model of these weights, dtype and device is kept."""
    precision = NAMES[dtype]
    exporter = f"torchscript-torch{torch.__version__.split('+')[0]}-{device.type}"
    return artifact_key(loaded, precision, exporter).path(root) / "model.pt"


def artifact_key(loaded: LoadedModel, precision: str, exporter: str) -> ArtifactKey:
    # A graph that takes any canvas is another graph than one of a fixed size.
    shapes = "-any-canvas" if any_canvas(loaded) else ""
    return ArtifactKey(loaded.name, loaded_digest(loaded), loaded.transform.crop_size,
                       precision, exporter + shapes)  # fmt: skip


def ensure_onnx(root: Path, loaded: LoadedModel) -> Path:
    """The fp32 ONNX artefact, exported now if it is not there yet."""

    def export(out: Path) -> None:
        graph, outputs = exported_graph(loaded)
        divisible = loaded.transform.size_divisible if any_canvas(loaded) else None
        export_onnx(copy.deepcopy(graph), input_shape(loaded), out, outputs, divisible)

    return _made(root, artifact_key(loaded, "fp32", onnx_exporter()), ONNX_FILE, export,
                 f"exported {loaded.name} to ONNX")  # fmt: skip


def _made(root: Path, key: ArtifactKey, filename: str, make: Callable[[Path], None],
          done: str) -> Path:  # fmt: skip
    """The artefact ``filename`` of ``key`` under ``root``: found, or written by ``make`` into
    a scratch file now and moved into place (logged as ``done``)."""
    path = find(root, key, filename)
    if path is None:
        with building(root, key) as scratch:
            make(scratch / filename)
        path = key.path(root) / filename
        logger.info("%s: %s", done, path)
    return path


def exported_graph(loaded: LoadedModel) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """What of the model a runtime runs, and its outputs' names: the whole model, or a
    detector's graph (``tasks.adapters.detector_parts``)."""
    if loaded.task != "detect":
        _refuse_an_export(loaded)
        return loaded.module, (OUTPUT_NAME,)
    parts = runtime_parts(loaded)
    return parts.graph, parts.outputs


def exportable(loaded: LoadedModel) -> bool:
    """Whether the module can be exported at all (not a TorchScript export, which PyTorch
    alone runs)."""
    return bool(getattr(loaded.module, "exportable", True))


def _refuse_an_export(loaded: LoadedModel) -> None:
    if not exportable(loaded):
        raise StartupError(
            f"{loaded.name} is a TorchScript export, which PyTorch alone runs (BACKEND=torch, "
            f"or auto): serve the checkpoint it was exported from on ONNX Runtime or OpenVINO"
        )


def runtime_parts(loaded: LoadedModel) -> DetectorParts:
    """A detector's parts for a runtime, or the one line that says why it has none."""
    _refuse_an_export(loaded)
    parts = detector_parts(loaded.module, loaded.transform.example_canvas)
    if parts is None:
        raise StartupError(
            f"{loaded.name} is served by BACKEND=torch (or auto): it answers a list of boxes "
            f"per image, of data-dependent sizes, which an export cannot take (torchvision's "
            f"SSD, SSDlite, RetinaNet, FCOS, Faster R-CNN, Mask R-CNN and Keypoint R-CNN, and "
            f"models returning padded (boxes, scores, labels) tensors run on every backend)"
        )
    return parts


def runtime_decode(loaded: LoadedModel) -> Decode | None:
    """What PyTorch runs on a runtime's outputs: a detector's decoding of its graph's, none
    for another task's model."""
    return runtime_parts(loaded).decode if loaded.task == "detect" else None


def ensure_box_head(root: Path, loaded: LoadedModel, backend: str) -> Path | None:
    """A two-stage detector's box head for ``backend`` (fp32 ONNX, or OpenVINO IR converted
    from it), exported now if it is not there yet; None for a model without one. It stays
    fp32 beside an INT8 backbone: the gate judges the graph it quantised."""
    if loaded.task != "detect":
        return None
    parts = runtime_parts(loaded)
    if parts.box_head is None:
        return None
    path = _made(root, artifact_key(loaded, "fp32", onnx_exporter() + BOX_HEAD), ONNX_FILE,
                 lambda out: _export_box_head(loaded, parts, out),
                 f"exported the box head of {loaded.name} to ONNX")  # fmt: skip
    if backend != "openvino":
        return path
    return _made(root, artifact_key(loaded, "fp32", openvino_exporter() + BOX_HEAD),
                 OPENVINO_FILE, lambda out: convert_to_openvino(path, out),
                 f"converted the box head of {loaded.name} to OpenVINO IR")  # fmt: skip


def _export_box_head(loaded: LoadedModel, parts: DetectorParts, path: Path) -> None:
    """The box head with a dynamic number of proposals, on six proposals' random features."""
    assert parts.box_head is not None
    assert isinstance(parts.decode, DetectorDecoding)
    decode = parts.decode.decoder(loaded.transform.example_canvas)
    assert isinstance(decode, RcnnDecode)
    generator = torch.Generator().manual_seed(0)
    pooled = torch.randn((6, *decode.pooled_shape), generator=generator)
    count = torch.export.Dim("rois", min=1, max=1 << 20)
    export_graph(copy.deepcopy(parts.box_head), (pooled,), path, BOX_HEAD_INPUTS,
                 BOX_HEAD_OUTPUTS, ({0: count},))  # fmt: skip


def int8_key(loaded: LoadedModel, backend: str) -> ArtifactKey:
    exporter = onnx_exporter() + QDQ
    if backend == "openvino":
        exporter = f"{openvino_exporter()}{NNCF}"
    return artifact_key(loaded, "int8", exporter)


def ensure_openvino(root: Path, loaded: LoadedModel, precision: str) -> Path:
    """The fp32 OpenVINO IR, converted from the ONNX artefact now if it is not there yet."""
    return _made(root, artifact_key(loaded, precision, openvino_exporter()), OPENVINO_FILE,
                 lambda out: convert_to_openvino(ensure_onnx(root, loaded), out),
                 f"converted {loaded.name} to OpenVINO IR")  # fmt: skip


def int8_artifact(root: Path, loaded: LoadedModel, backend: str) -> Path | None:
    """The INT8 model of ``backend`` built for these weights under ``root``, if there is one."""
    filename = OPENVINO_FILE if backend == "openvino" else ONNX_FILE
    return find(root, int8_key(loaded, backend), filename)

"""Ultralytics YOLO models from their own files: a training checkpoint (``best.pt``) or its
TorchScript export (``*.torchscript``).

Everything served comes from the file: the task, the class names, the input size and the
stride. A checkpoint pickles Ultralytics' classes, so it is read by Ultralytics' own loader
(the ``yolo`` extra, imported only here and only for such a file), fused as its predictor
fuses it; an export needs torch alone, and carries the same fields as JSON in its
``config.txt`` extra file.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.engine.tasks.yolo import (
    SERVED_TASKS,
    YoloClassifier,
    YoloDecode,
    YoloDetector,
    YoloGraph,
    yolo_classify_transform,
    yolo_transform,
)
from preprocessing import TransformConfig

logger = logging.getLogger("batchserve")

SUFFIXES = (".pt", ".torchscript")
INSTALL = "pip install 'batchserve[yolo]'"


class YoloFileError(ValueError):
    """The file is not a YOLO model this server can serve; the message says why."""


@dataclass(frozen=True)
class YoloModel:
    """A YOLO model made to take the server's batch, and what its file says of it."""

    module: nn.Module
    task: str  # the server's: detect or classify
    labels: tuple[str, ...]
    transform: TransformConfig
    instances: tuple[str, ...]


def yolo_path(name: str) -> Path | None:
    """``name`` as the path of a YOLO file (by its suffix), or None."""
    path = Path(name)
    return path if ":" not in name and path.suffix in SUFFIXES else None


def load_yolo(path: Path, image_size: int | None = None) -> YoloModel:
    """The YOLO model in ``path``, served at ``image_size`` (rounded up to its stride; unset:
    the size it was trained or exported at)."""
    if not path.is_file():
        raise YoloFileError(f"MODEL={path}: no such file")
    if path.suffix == ".torchscript":
        model, fields = _exported(path)
    else:
        model, fields = _checkpoint(path)
    task = str(fields.get("task", ""))
    if task not in SERVED_TASKS:
        raise YoloFileError(
            f"{path} is a YOLO {task or 'model of no task'}: served are {', '.join(SERVED_TASKS)}"
        )
    labels = _names(fields.get("names"), path)
    stride = int(fields.get("stride") or 32)
    size = _size(image_size or fields.get("imgsz") or 640, stride, path)
    # An export of fixed shapes takes only the size it was exported at, every image centred
    # in its square (as Ultralytics' predictor then letterboxes it).
    fixed = path.suffix == ".torchscript" and not fields.get("dynamic")
    if fixed and size != _size(fields.get("imgsz") or 640, stride, path):
        raise YoloFileError(
            f"{path} was exported for {fields.get('imgsz')} inputs, not IMAGE_SIZE={image_size}"
        )
    if task == "classify":
        return YoloModel(YoloClassifier(model).eval(), "classify", labels,
                         yolo_classify_transform(size), ())  # fmt: skip
    keypoints = fields.get("kpt_shape") if task == "pose" else None
    shape = (int(keypoints[0]), int(keypoints[1])) if keypoints else None
    if shape is not None and shape[1] not in (2, 3):
        raise YoloFileError(f"{path}: keypoints of shape {shape} (x, y and maybe visibility)")
    decode = YoloDecode(len(labels), shape, masks=task == "segment",
                        end_to_end=bool(fields.get("end2end")))  # fmt: skip
    module = YoloDetector(YoloGraph(model), decode).eval()
    transform = yolo_transform(size, stride)
    if fixed:
        transform = replace(transform, buckets=((size, size),))
    instances = ("keypoints",) if shape else ("masks",) if task == "segment" else ()
    return YoloModel(module, "detect", labels, transform, instances)


def _checkpoint(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    if not _pickles_ultralytics(path):
        raise YoloFileError(
            f"{path} is not an Ultralytics checkpoint (no Ultralytics model pickled in it): a "
            f"state_dict goes in WEIGHTS, with MODEL naming its architecture"
        )
    if importlib.util.find_spec("ultralytics") is None:
        raise YoloFileError(f"{path} is an Ultralytics checkpoint: serving it needs {INSTALL}")
    from ultralytics.nn.tasks import load_checkpoint

    try:
        model, _ = load_checkpoint(str(path), device="cpu")
        # Its predictor's default (no ``nms=False``): a head with both branches answers by
        # the one-to-many one and suppression; fused, the other branch is dropped.
        if getattr(model, "end2end", False):
            model.end2end = False
        model = model.fuse(verbose=False).eval()
    except Exception as exc:
        raise YoloFileError(f"{path}: Ultralytics cannot load it ({exc})") from exc
    args = getattr(model, "args", {}) or {}
    head = model.model[-1] if hasattr(model, "model") else None
    fields = {
        "task": getattr(model, "task", None),
        "names": getattr(model, "names", None),
        "stride": int(max(model.stride)) if hasattr(model, "stride") else 32,
        "imgsz": args.get("imgsz"),
        "kpt_shape": getattr(head, "kpt_shape", None),
        "end2end": bool(getattr(model, "end2end", False)),
    }
    return model, fields


def _pickles_ultralytics(path: Path) -> bool:
    """Whether a ``torch.save`` archive pickles Ultralytics' classes (read without unpickling
    anything)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("data.pkl")]
            return any(b"ultralytics." in archive.read(name) for name in pickles)
    except (zipfile.BadZipFile, OSError):
        return False


def _exported(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    extra = {"config.txt": ""}
    try:
        with warnings.catch_warnings():  # deprecated in torch, and what Ultralytics exports
            warnings.simplefilter("ignore", FutureWarning)
            model = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), map_location="cpu", _extra_files=extra
            )
    except Exception as exc:
        raise YoloFileError(f"{path} is not a TorchScript file ({exc})") from exc
    if not extra["config.txt"]:
        raise YoloFileError(
            f"{path} carries no Ultralytics metadata (config.txt): export it with "
            f"'yolo export format=torchscript'"
        )
    try:
        fields = json.loads(extra["config.txt"])
    except ValueError as exc:
        raise YoloFileError(f"{path}: its config.txt is not JSON ({exc})") from exc
    if not isinstance(fields, dict):
        raise YoloFileError(f"{path}: its config.txt is not Ultralytics' metadata")
    return model.eval(), fields


def _names(names: Any, path: Path) -> tuple[str, ...]:
    if isinstance(names, dict):
        try:
            indexed = {int(key): str(value) for key, value in names.items()}
        except ValueError:
            indexed = {}
        if indexed and sorted(indexed) == list(range(len(indexed))):
            return tuple(indexed[index] for index in range(len(indexed)))
    if isinstance(names, list) and names:
        return tuple(str(name) for name in names)
    raise YoloFileError(f"{path} names no classes (its names field is {names!r})")


def _size(value: Any, stride: int, path: Path) -> int:
    sides = value if isinstance(value, list | tuple) else [value]
    if len({int(side) for side in sides}) != 1:
        raise YoloFileError(f"{path}: an input of {sides} (only squares are served)")
    side = int(sides[0])
    rounded = side + (-side % stride)  # as Ultralytics rounds imgsz up to the stride
    if rounded != side:
        logger.warning("%s: input size %d rounded up to %d, a multiple of its stride %d",
                       path, side, rounded, stride)  # fmt: skip
    return rounded

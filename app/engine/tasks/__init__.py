"""What a model answers: its top classes (``classify``), boxes (``detect``), a mask of class
indices (``segment``) or a vector (``embed``).

The task travels with the model everywhere: its input geometry (a centre crop for classifiers
and encoders; a letterbox that keeps the whole image for detectors and segmenters, so that
images of any size share one batch), what its forward pass must return, and how a batch's
outputs become each image's answer in the original image's pixels. The batcher, admission
and the front ends stay blind to it: they carry images in and answers out.
"""

from __future__ import annotations

from typing import Literal

Task = Literal["classify", "detect", "segment", "embed"]
TASKS: tuple[Task, ...] = ("classify", "detect", "segment", "embed")

# torchvision's architectures of each task, by the start of their names.
DETECTORS = ("fasterrcnn_", "retinanet_", "fcos_", "ssd", "maskrcnn_")
SEGMENTERS = ("deeplabv3_", "fcn_", "lraspp_")


def resolve_task(setting: str, model: str) -> Task:
    """The task of ``model`` (``TASK=auto``: inferred for torchvision's own architectures,
    ``classify`` for anything else)."""
    if setting != "auto":
        for task in TASKS:
            if task == setting:
                return task
        raise ValueError(f"unknown task {setting!r}: {', '.join(TASKS)}")
    if ":" not in model:
        if model.startswith(DETECTORS):
            return "detect"
        if model.startswith(SEGMENTERS):
            return "segment"
    return "classify"


def letterboxed(task: str) -> bool:
    """Whether the task sees the whole image (letterboxed) rather than its centre crop."""
    return task in ("detect", "segment")


def default_size(task: str, model: str) -> int | None:
    """The input side a task's model is served at when ``IMAGE_SIZE`` names none (None: the
    weights' own preset): detectors by the size in their name (``ssdlite320_...``: 320), else
    640; segmenters 520, as torchvision's weights are evaluated."""
    if task == "detect":
        for size in (300, 320, 512, 640):
            if str(size) in model:
                return size
        return 640
    if task == "segment":
        return 520
    return None


def server_nms(task: str, model: str, nms_iou: float) -> float | None:
    """The IoU of the server's non-maximum suppression for a detector (``NMS_IOU``): none for
    torchvision's, which run their own, nor at 0."""
    if task != "detect" or ":" not in model or nms_iou == 0:
        return None
    return nms_iou

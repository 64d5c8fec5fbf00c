"""What a model answers: its top classes (``classify``), boxes (``detect``, with instance
masks or keypoints where the model gives them), a mask of class indices (``segment``) or a
vector (``embed``).

The task travels with the model everywhere: what its forward pass must return, and how a
batch's outputs become each image's answer in the original image's pixels. What the model
sees of an image is its library's rule (``preprocessing.placement``), not the task's. The
batcher, admission and the front ends stay blind to it: they carry images in and answers out.
"""

from __future__ import annotations

from typing import Literal

Task = Literal["classify", "detect", "segment", "embed"]
TASKS: tuple[Task, ...] = ("classify", "detect", "segment", "embed")

# torchvision's architectures of each task, by the start of their names.
DETECTORS = ("fasterrcnn_", "retinanet_", "fcos_", "ssd", "maskrcnn_", "keypointrcnn_")
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


def own_fit(task: str) -> str:
    """How a model of one's own is fitted when ``FIT=auto`` (it brings no rule of a library):
    a classifier's or an encoder's centre crop; a detector's or a segmenter's letterbox, which
    keeps the whole image."""
    return "letterbox" if task in ("detect", "segment") else "center-crop"


def default_size(task: str) -> int | None:
    """The input side of a model of one's own, letterboxed, when ``IMAGE_SIZE`` names none
    (None: the preset's centre crop): a detector's 640, a segmenter's 520."""
    return {"detect": 640, "segment": 520}.get(task)


def server_nms(task: str, model: str, nms_iou: float) -> float | None:
    """The IoU of the server's non-maximum suppression for a detector (``NMS_IOU``): none for
    torchvision's and transformers', which answer without one or run their own, nor at 0."""
    if task != "detect" or ":" not in model or model.startswith("hf:") or nms_iou == 0:
        return None
    return nms_iou

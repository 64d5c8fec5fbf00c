"""The start-up check of a detector, a segmenter or an encoder, in its task's own terms.

A classifier's check compares class probabilities (``gate.compare``). A detector's answer is a
set of boxes, a segmenter's a mask and an encoder's a vector, so an exported detector is
judged by how many of eager PyTorch's boxes it finds and how many of its own eager PyTorch
finds (``boxes``), a segmenter by how many of each image's pixels get the class eager PyTorch
gives them, and an encoder by the cosine between its vector and eager PyTorch's, image by
image, through the whole serving path (decode, letterbox or crop, collate, forward, the
answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from app.engine.checks.boxes import INSTANCE_FIGURES, compare_detections
from app.engine.checks.gate import served
from app.engine.engine import InferenceEngine, Prediction

TASKS_CHECKED = ("detect", "segment", "embed")


@dataclass(frozen=True)
class TaskBounds:
    """What a detector, a segmenter or an encoder must meet against eager fp32 PyTorch: the
    shares of each side's boxes the other finds (and, where it answers them, the mean IoU of
    the found boxes' masks and the share of their keypoints within PCK@0.1), the share of
    pixels of the worst image with the same class, the cosine of the worst image's vectors."""

    min_pixel_agreement: float
    min_cosine: float
    min_box_recall: float = 0.0
    min_box_precision: float = 0.0
    min_mask_iou: float = 0.0
    min_keypoint_pck: float = 0.0


# fp32 computes the same function within float rounding: a pixel changes class only where two
# classes' logits all but tie, a box is lost only where it ties with the last one served.
# Reduced precisions move more; INT8 was judged by its gate.
TASK_CHECK_BOUNDS = {
    "fp32": TaskBounds(
        min_pixel_agreement=0.99, min_cosine=0.9999, min_box_recall=0.95, min_box_precision=0.95,
        min_mask_iou=0.9, min_keypoint_pck=0.9,
    ),
    "fp16": TaskBounds(
        min_pixel_agreement=0.9, min_cosine=0.99, min_box_recall=0.8, min_box_precision=0.8,
        min_mask_iou=0.8, min_keypoint_pck=0.8,
    ),
    "bf16": TaskBounds(
        min_pixel_agreement=0.9, min_cosine=0.99, min_box_recall=0.8, min_box_precision=0.8,
        min_mask_iou=0.8, min_keypoint_pck=0.8,
    ),
    "int8": TaskBounds(
        min_pixel_agreement=0.5, min_cosine=0.9, min_box_recall=0.5, min_box_precision=0.5,
        min_mask_iou=0.5, min_keypoint_pck=0.5,
    ),
}  # fmt: skip

# Scores this close to a side's last served box tie with it (of a random-weight SSDlite's 3234
# anchors, every one scores 1/91 to eight digits: which of them are served is rounding).
CHECK_TIE = 1e-3

# Per task, each bound and the report's figure it holds.
_JUDGED = {
    "detect": {
        "min_box_recall": "box_recall",
        "min_box_precision": "box_precision",
        "min_mask_iou": "mask_iou",
        "min_keypoint_pck": "keypoint_pck",
    },
    "segment": {"min_pixel_agreement": "min_pixel_agreement"},
    "embed": {"min_cosine": "min_cosine"},
}


def answers(engine: InferenceEngine, images: Sequence[bytes], batch_size: int = 8) -> list[Any]:
    """Each image's detections, mask or vector, through the whole serving path."""
    return [_answer(engine.task, prediction) for prediction in served(engine, images, batch_size)]


def _answer(task: str, prediction: Prediction) -> Any:
    if task == "detect":
        return prediction.detected
    return prediction.mask if task == "segment" else prediction.embedding


def compare_task(task: str, reference: Sequence[Any], candidate: Sequence[Any]) -> dict[str, Any]:
    """How closely the candidate's answers follow the reference's, image by image."""
    if task == "detect":
        return compare_detections(reference, candidate, tie=CHECK_TIE)
    if task == "segment":
        shares = [float(np.mean(a == b)) for a, b in zip(reference, candidate, strict=True)]
        return {"images": len(shares), "min_pixel_agreement": min(shares),
                "mean_pixel_agreement": float(np.mean(shares))}  # fmt: skip
    cosines = [_cosine(a, b) for a, b in zip(reference, candidate, strict=True)]
    return {"images": len(cosines), "min_cosine": min(cosines),
            "mean_cosine": float(np.mean(cosines))}  # fmt: skip


def _cosine(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norms == 0.0:  # two zero vectors agree; one alone does not
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / norms)


def judged_task(task: str, report: dict[str, Any], bounds: TaskBounds) -> dict[str, Any]:
    """The report with its bounds and verdict attached (what is kept and shown). A side with
    no box misses none: recall is 1 where the reference answers none, precision where the
    candidate does; masks and keypoints are judged where the reference answers them."""
    failures = []
    figures = {name: figure for name, figure in _JUDGED[task].items()
               if figure not in INSTANCE_FIGURES or figure in report}  # fmt: skip
    judged = {name: asdict(bounds)[name] for name in figures}
    for name, bound in judged.items():
        value = report[_JUDGED[task][name]]
        value = 1.0 if value is None else value
        if value < bound:
            failures.append(f"{name.removeprefix('min_')} {value:.6f} < {bound}")
    return {**report, "bounds": judged, "passed": not failures, "failures": failures}

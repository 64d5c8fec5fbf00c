"""The INT8 accuracy gate of a detector, a segmenter or an encoder, in its task's own terms.

A classifier's gate compares class probabilities (``gate.compare``). Against eager fp32
PyTorch, through the whole serving path, on the held-out gate images:

- a detector's boxes: fp32's confident boxes (scoring at least ``confident_score``) matched
  to INT8's of the same label at IoU >= 0.5 (``boxes``): the share of them INT8 finds
  (recall), the share of INT8's confident boxes fp32 finds (precision), and the mean IoU of
  the matches (how far the found boxes moved); an instance segmenter's mean mask IoU of the
  matches, a keypoint detector's share of the matches' keypoints within a tenth of the box's
  longer side (PCK@0.1; ``boxes``). Too few confident boxes to judge by
  (``min_confident_boxes``) is a refusal, never a pass: a gate set on which fp32 is
  confident of nothing says nothing of INT8;
- a segmenter's masks: the share of each image's pixels given fp32's class (the worst image
  and the mean), and the mean IoU of fp32's and INT8's masks (per class, pixels pooled over
  every image, averaged over the classes either gives some pixel): a model may agree on most
  pixels of an image while losing a small class entirely, which only the IoU shows;
- an encoder's vectors: the cosine of each image's two vectors (the mean and the worst), and
  how often an image's nearest neighbour among the gate images (by cosine, itself left out)
  is the same in both: search and deduplication answer with neighbours, and a small drift of
  every vector can still reorder them.

Each figure has a floor: a bound named ``min_<figure>``; a bound without that prefix is a
parameter of the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from app.engine.checks.boxes import INSTANCE_FIGURES, compare_detections
from app.engine.checks.gate import compare, probabilities
from app.engine.checks.task_check import answers
from app.engine.engine import InferenceEngine

TASKS_GATED = ("detect", "segment", "embed")


@dataclass(frozen=True)
class DetectBounds:
    """What an INT8 detector must keep of fp32's confident boxes (and of their masks and
    keypoints, judged where fp32 answers them)."""

    confident_score: float
    min_confident_boxes: int
    min_box_recall: float
    min_box_precision: float
    min_matched_iou: float
    min_mask_iou: float = 0.0
    min_keypoint_pck: float = 0.0


@dataclass(frozen=True)
class SegmentBounds:
    """What an INT8 segmenter must keep of fp32's masks."""

    min_worst_pixel_agreement: float
    min_mean_iou: float


@dataclass(frozen=True)
class EmbedBounds:
    """What an INT8 encoder must keep of fp32's vectors."""

    min_mean_cosine: float
    min_worst_cosine: float
    min_neighbour_agreement: float


TaskBounds = DetectBounds | SegmentBounds | EmbedBounds


def compare_answers(
    task: str, reference: Sequence[Any], candidate: Sequence[Any], confident_score: float = 0.5
) -> dict[str, Any]:
    """How closely the candidate's boxes, masks or vectors follow the reference's (a
    detector's judged from ``confident_score``)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference answers against {len(candidate)}")
    if task == "detect":
        figures = compare_detections(reference, candidate, min_score=confident_score)
        return figures | {"confident_boxes": figures["reference_boxes"]}
    if task == "segment":
        return _masks(reference, candidate)
    if task == "embed":
        return _vectors(np.stack(reference), np.stack(candidate))
    raise ValueError(f"no task gate for TASK={task}")


def _masks(
    reference: Sequence[np.ndarray[Any, Any]], candidate: Sequence[np.ndarray[Any, Any]]
) -> dict[str, Any]:
    pairs = list(zip(reference, candidate, strict=True))
    shares = [float(np.mean(a == b)) for a, b in pairs]
    classes = 1 + max(max(int(a.max()), int(b.max())) for a, b in pairs)
    intersection = np.zeros(classes, dtype=np.int64)
    union = np.zeros(classes, dtype=np.int64)
    for a, b in pairs:
        a, b = a.ravel().astype(np.int64), b.ravel().astype(np.int64)
        both = np.bincount(a[a == b], minlength=classes)
        intersection += both
        union += np.bincount(a, minlength=classes) + np.bincount(b, minlength=classes) - both
    present = union > 0
    ious = intersection[present] / union[present]
    return {
        "images": len(shares),
        "worst_pixel_agreement": min(shares),
        "mean_pixel_agreement": float(np.mean(shares)),
        "mean_iou": float(ious.mean()),
        "worst_class_iou": float(ious.min()),
        "classes_seen": int(present.sum()),
    }


def _vectors(reference: np.ndarray[Any, Any], candidate: np.ndarray[Any, Any]) -> dict[str, Any]:
    ref, cand = _unit(reference), _unit(candidate)
    cosines = (ref * cand).sum(axis=1)
    report: dict[str, Any] = {
        "images": len(cosines),
        "mean_cosine": float(cosines.mean()),
        "worst_cosine": float(cosines.min()),
    }
    if len(cosines) < 2:  # no neighbour to find
        report["neighbour_agreement"] = None
        return report
    report["neighbour_agreement"] = float(np.mean(_nearest(ref) == _nearest(cand)))
    return report


def _unit(vectors: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    vectors = vectors.astype(np.float64)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: np.ndarray[Any, Any] = np.divide(
        vectors, norms, out=np.zeros_like(vectors), where=norms > 0
    )
    return unit


def _nearest(unit: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each row's nearest other row by cosine."""
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    nearest: np.ndarray[Any, Any] = similarity.argmax(axis=1)
    return nearest


def figure_names(bounds: Any) -> list[str]:
    """The figures ``bounds`` judge."""
    return [field.name.removeprefix("min_") for field in fields(bounds)
            if field.name.startswith("min_")]  # fmt: skip


def too_few_to_judge(report: dict[str, Any], bounds: Any) -> str | None:
    """Why the report cannot judge at all (a detector's gate set with too few of fp32's
    confident boxes: no recipe can pass it), or None."""
    if not isinstance(bounds, DetectBounds):
        return None
    count = report.get("confident_boxes")
    if isinstance(count, int) and count >= bounds.min_confident_boxes:
        return None
    return (f"too few confident boxes to judge ({count} < {bounds.min_confident_boxes}, "
            f"scoring at least {bounds.confident_score})")  # fmt: skip


def task_verdict(report: dict[str, Any], bounds: TaskBounds) -> list[str]:
    """The floors the report misses (empty: it passes); a refusal to judge alone."""
    refusal = too_few_to_judge(report, bounds)
    if refusal is not None:
        return [refusal]
    failures = []
    for name, bound in asdict(bounds).items():
        if not name.startswith("min_"):
            continue
        figure = name.removeprefix("min_")
        if figure in INSTANCE_FIGURES and figure not in report:
            continue  # a detector without masks or keypoints
        value = report.get(figure)
        what = figure.replace("_", " ")
        if not isinstance(value, int | float) or isinstance(value, bool):
            failures.append(f"no {what} was measured")
        elif value < bound:
            failures.append(f"{what} {value:.4f} < {bound}")
    return failures


def gate_answers(engine: InferenceEngine, images: Sequence[bytes]) -> Any:
    """What a gate compares, through the whole serving path: every class's probability
    (``[images, classes]``) for a classifier, else each image's boxes, mask or vector."""
    return probabilities(engine, images) if engine.task == "classify" else answers(engine, images)


def gate_compare(task: str, reference: Any, candidate: Any, bounds: Any) -> dict[str, Any]:
    """The figures of the candidate's answers against the reference's, in the task's terms
    (those ``bounds`` judge)."""
    if task == "classify":
        return compare(reference, candidate)
    if isinstance(bounds, DetectBounds):
        return compare_answers(task, reference, candidate, bounds.confident_score)
    return compare_answers(task, reference, candidate)

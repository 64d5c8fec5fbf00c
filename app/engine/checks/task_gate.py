"""The INT8 accuracy gate of a segmenter or an encoder, in its task's own terms.

A classifier's gate compares class probabilities (``gate.compare``). Against eager fp32
PyTorch, through the whole serving path, on the held-out gate images:

- a segmenter's masks: the share of each image's pixels given fp32's class (the worst image
  and the mean), and the mean IoU of fp32's and INT8's masks (per class, pixels pooled over
  every image, averaged over the classes either gives some pixel): a model may agree on most
  pixels of an image while losing a small class entirely, which only the IoU shows;
- an encoder's vectors: the cosine of each image's two vectors (the mean and the worst), and
  how often an image's nearest neighbour among the gate images (by cosine, itself left out)
  is the same in both: search and deduplication answer with neighbours, and a small drift of
  every vector can still reorder them.

Each figure has a floor: a bound named ``min_<figure>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from app.engine.checks.gate import compare, probabilities
from app.engine.checks.task_check import answers
from app.engine.engine import InferenceEngine

TASKS_GATED = ("segment", "embed")


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


TaskBounds = SegmentBounds | EmbedBounds


def compare_answers(
    task: str, reference: Sequence[np.ndarray[Any, Any]], candidate: Sequence[np.ndarray[Any, Any]]
) -> dict[str, Any]:
    """How closely the candidate's masks or vectors follow the reference's."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference answers against {len(candidate)}")
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
    return [field.name.removeprefix("min_") for field in fields(bounds)]


def task_verdict(report: dict[str, Any], bounds: TaskBounds) -> list[str]:
    """The floors the report misses (empty: it passes)."""
    failures = []
    for name, bound in asdict(bounds).items():
        figure = name.removeprefix("min_")
        value = report.get(figure)
        what = figure.replace("_", " ")
        if not isinstance(value, int | float) or isinstance(value, bool):
            failures.append(f"no {what} was measured")
        elif value < bound:
            failures.append(f"{what} {value:.4f} < {bound}")
    return failures


def gate_answers(engine: InferenceEngine, images: Sequence[bytes]) -> Any:
    """What a gate compares, through the whole serving path: every class's probability
    (``[images, classes]``) for a classifier, else each image's mask or vector."""
    return probabilities(engine, images) if engine.task == "classify" else answers(engine, images)


def gate_compare(task: str, reference: Any, candidate: Any) -> dict[str, Any]:
    """The figures of the candidate's answers against the reference's, in the task's terms."""
    if task == "classify":
        return compare(reference, candidate)
    return compare_answers(task, reference, candidate)

"""The start-up check of a segmenter or an encoder, in its task's own terms.

A classifier's check compares class probabilities (``gate.compare``). A segmenter's answer is
a mask and an encoder's a vector, so an exported segmenter is judged by how many of each
image's pixels get the class eager PyTorch gives them, and an encoder by the cosine between
its vector and eager PyTorch's, image by image, through the whole serving path (decode,
letterbox or crop, collate, forward, the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from app.engine.checks.gate import served
from app.engine.engine import InferenceEngine, Prediction

TASKS_CHECKED = ("segment", "embed")


@dataclass(frozen=True)
class TaskBounds:
    """What a segmenter or an encoder must meet against eager fp32 PyTorch: the share of
    pixels of the worst image with the same class, the cosine of the worst image's vectors."""

    min_pixel_agreement: float
    min_cosine: float


# fp32 computes the same function within float rounding: a pixel changes class only where two
# classes' logits all but tie. Reduced precisions move more; INT8 was judged by its gate.
TASK_CHECK_BOUNDS = {
    "fp32": TaskBounds(min_pixel_agreement=0.99, min_cosine=0.9999),
    "fp16": TaskBounds(min_pixel_agreement=0.9, min_cosine=0.99),
    "bf16": TaskBounds(min_pixel_agreement=0.9, min_cosine=0.99),
    "int8": TaskBounds(min_pixel_agreement=0.5, min_cosine=0.9),
}


def answers(engine: InferenceEngine, images: Sequence[bytes], batch_size: int = 8) -> list[Any]:
    """Each image's mask (segment) or vector (embed), through the whole serving path."""
    return [_answer(engine.task, prediction) for prediction in served(engine, images, batch_size)]


def _answer(task: str, prediction: Prediction) -> Any:
    return prediction.mask if task == "segment" else prediction.embedding


def compare_task(task: str, reference: Sequence[Any], candidate: Sequence[Any]) -> dict[str, Any]:
    """How closely the candidate's masks or vectors follow the reference's, image by image."""
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
    """The report with its bounds and verdict attached (what is kept and shown)."""
    figure, bound = (
        ("min_pixel_agreement", bounds.min_pixel_agreement)
        if task == "segment" else ("min_cosine", bounds.min_cosine)
    )  # fmt: skip
    value = report[figure]
    failures = [] if value >= bound else [f"{figure.removeprefix('min_')} {value:.6f} < {bound}"]
    return {**report, "bounds": {figure: asdict(bounds)[figure]}, "passed": not failures,
            "failures": failures}  # fmt: skip

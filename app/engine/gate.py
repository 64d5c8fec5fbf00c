"""Do two configurations of a model give the same answers? Measured on the same images.

One comparison serves three purposes, with different bounds:

- the start-up check of a non-PyTorch backend against eager fp32 PyTorch (catches a broken
  export: a wrong graph, a fixed batch dimension);
- the INT8 accuracy gate, whose report is stored beside the INT8 model and must pass before
  the model serves;
- ``benchmarks/accuracy.py``, for any two configurations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from app.engine.engine import InferenceEngine, InferenceRequest

CONFIDENT = 0.5  # a reference top-1 probability at least this high is a confident answer


@dataclass(frozen=True)
class Bounds:
    """What a candidate must meet against the reference.

    ``min_confident_top1_agreement`` counts only the images whose reference answer is
    confident: where the reference itself hesitates between near-equal classes, a flip says
    little about accuracy, where it is sure, a flip is an error.
    """

    min_top1_agreement: float
    max_probability_difference: float
    min_top5_overlap: float = 0.0
    min_confident_top1_agreement: float = 0.0
    max_top1_drop: float = 1.0  # accuracy points, with labelled images


# The start-up check: an export must compute the same function. fp32 runtimes match eager
# PyTorch within float rounding; reduced precisions within their rounding; INT8 models were
# judged by their gate already, so the check only has to catch a broken artefact.
CHECK_BOUNDS = {
    "fp32": Bounds(min_top1_agreement=0.99, max_probability_difference=1e-3),
    "fp16": Bounds(min_top1_agreement=0.9, max_probability_difference=0.05),
    "bf16": Bounds(min_top1_agreement=0.9, max_probability_difference=0.05),
    "int8": Bounds(min_top1_agreement=0.5, max_probability_difference=0.5),
}
# The INT8 gate, on real photos and their variants (crops, mirror images, colour changes,
# harsh recompression): every confident answer kept, most of the rest too, the top five nearly
# the same, no probability moved by more than a quarter.
INT8_GATE = Bounds(
    min_top1_agreement=0.8,
    min_confident_top1_agreement=0.98,
    min_top5_overlap=0.85,
    max_probability_difference=0.25,
    max_top1_drop=0.01,
)


def probabilities(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int = 8
) -> torch.Tensor:
    """Every class's probability for every image, ``[images, classes]``, through the whole
    serving path (decode, resize, crop, collate, forward, softmax)."""
    rows: list[torch.Tensor] = []
    classes = engine.num_classes
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        requests = [InferenceRequest(engine.prepare(data), classes) for data in chunk]
        for outcome in engine.run_batch(requests):
            if isinstance(outcome, BaseException):
                raise outcome
            row = torch.zeros(classes)
            for entry in outcome.classes:
                row[entry["index"]] = entry["score"]
            rows.append(row)
    return torch.stack(rows)


def compare(
    reference: torch.Tensor, candidate: torch.Tensor, truth: Sequence[int] | None = None
) -> dict[str, Any]:
    """Top-1 agreement, mean top-5 overlap and the largest class-probability difference (and,
    with the true classes, both sides' top-1 and top-5 accuracy)."""
    count = reference.shape[0]
    k = min(5, reference.shape[1])
    ref_top = reference.topk(k, dim=1).indices
    cand_top = candidate.topk(k, dim=1).indices
    overlap = sum(
        len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(ref_top, cand_top, strict=True)
    )
    # The reference's top class is also the candidate's (an exact tie for first counts: which
    # of two equal classes a sort puts first is arbitrary).
    same_top1 = candidate.gather(1, ref_top[:, :1]).squeeze(1) >= candidate.max(dim=1).values
    confident = reference.max(dim=1).values >= CONFIDENT
    report: dict[str, Any] = {
        "images": count,
        "top1_agreement": float(same_top1.float().mean()),
        "confident_images": int(confident.sum()),
        "confident_top1_agreement": (
            float(same_top1[confident].float().mean()) if confident.any() else 1.0
        ),
        "top5_overlap": overlap / count,
        "max_probability_difference": float((reference - candidate).abs().max()),
        "labelled": truth is not None,
    }
    if truth is not None:
        labels = torch.tensor(list(truth))
        for name, top in (("reference", ref_top), ("candidate", cand_top)):
            report[f"{name}_top1"] = float((top[:, 0] == labels).float().mean())
            report[f"{name}_top5"] = float((top == labels[:, None]).any(dim=1).float().mean())
    return report


def verdict(report: dict[str, Any], bounds: Bounds) -> list[str]:
    """The bounds the report misses (empty: it passes)."""
    failures = []
    if report["top1_agreement"] < bounds.min_top1_agreement:
        failures.append(
            f"top-1 agreement {report['top1_agreement']:.4f} < {bounds.min_top1_agreement}"
        )
    if report["confident_top1_agreement"] < bounds.min_confident_top1_agreement:
        failures.append(
            f"top-1 agreement where the reference is confident "
            f"{report['confident_top1_agreement']:.4f} < {bounds.min_confident_top1_agreement}"
        )
    if report["top5_overlap"] < bounds.min_top5_overlap:
        failures.append(f"top-5 overlap {report['top5_overlap']:.4f} < {bounds.min_top5_overlap}")
    if report["max_probability_difference"] > bounds.max_probability_difference:
        failures.append(
            f"probability difference {report['max_probability_difference']:.4g} "
            f"> {bounds.max_probability_difference}"
        )
    if report["labelled"]:
        drop = report["reference_top1"] - report["candidate_top1"]
        if drop > bounds.max_top1_drop:
            failures.append(f"top-1 accuracy drops by {drop:.4f} > {bounds.max_top1_drop}")
    return failures


def judged(report: dict[str, Any], bounds: Bounds) -> dict[str, Any]:
    """The report with its bounds and verdict attached (what is stored and shown)."""
    failures = verdict(report, bounds)
    return {**report, "bounds": asdict(bounds), "passed": not failures, "failures": failures}

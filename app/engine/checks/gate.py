"""Do two configurations of a model give the same answers? Measured on the same images.

One comparison serves three purposes, with different bounds:

- the start-up check of a non-PyTorch backend against eager fp32 PyTorch (catches a broken
  export: a wrong graph, a fixed batch dimension);
- the INT8 accuracy gate, whose report is stored beside the INT8 model and must pass before
  the model serves;
- ``benchmarks/accuracy.py``, for any two configurations.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from app.engine.backends import Backend, TorchBackend
from app.engine.engine import ImageRequest, InferenceEngine, Prediction
from app.engine.model.loading import LoadedModel

# A confident answer: the reference gives its top class at least this probability, and at least
# twice its runner-up's (a 0.52 / 0.46 split is a hesitation, not an answer).
CONFIDENT = 0.5
# An answer the reference finds plausible: it gives the candidate's top class at least this
# share of the probability it gives its own (tabby for Egyptian cat, not teapot).
PLAUSIBLE = 0.5


@dataclass(frozen=True)
class Bounds:
    """What a candidate must meet against the reference.

    Agreement is counted where it means something: where the reference hesitates between
    near-equal classes, which one comes first says little about accuracy, and on images that
    look like nothing the model knows (textures, microscopy) it is noise; so the INT8 gate
    bounds the confident answers, the plausible ones and the average shift of the whole
    distribution (total variation: half the sum of the probability differences).
    """

    max_probability_difference: float
    min_top1_agreement: float = 0.0
    min_top5_overlap: float = 0.0
    min_confident_top1_agreement: float = 0.0
    min_plausible_top1: float = 0.0
    max_mean_total_variation: float = 1.0
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


def looser(judged_by: dict[str, Any], bounds: Any) -> list[str]:
    """The bounds in ``bounds`` (a dataclass of ``min_`` floors and ``max_`` ceilings, of any
    task) that are stricter than those a stored report was judged by, and its parameters
    (neither: a detector's confident score) that differ from those it was judged with."""

    def stricter(name: str, value: float) -> bool:
        stored = judged_by.get(name)
        if not isinstance(stored, int | float):
            return True
        if name.startswith("min_"):
            return value > stored
        return value < stored if name.startswith("max_") else value != stored

    return [name for name, value in asdict(bounds).items() if stricter(name, value)]


def eager_reference(
    loaded: LoadedModel,
    module: nn.Module | None = None,
    like: InferenceEngine | None = None,
    nms_iou: float | None = None,
) -> InferenceEngine:
    """Eager fp32 PyTorch on the CPU (on a copy of the model unless ``module`` is given): the
    reference every other configuration is judged against (answering as ``like`` does, or
    with the server's suppression at ``nms_iou``)."""
    module = copy.deepcopy(loaded.module) if module is None else module
    backend = TorchBackend(module.float(), torch.device("cpu"), torch.float32,
                           (3, *loaded.transform.example_canvas))  # fmt: skip
    return engine_for(loaded, backend, like, nms_iou)


def engine_for(
    loaded: LoadedModel,
    backend: Backend,
    like: InferenceEngine | None = None,
    nms_iou: float | None = None,
) -> InferenceEngine:
    """A plain engine around ``backend``, for comparisons outside the server; its answers
    made as ``like``'s are (a detector's suppression, an encoder's normalisation), or with
    the server's suppression at ``nms_iou``."""
    answering: dict[str, Any] = {"nms_iou": nms_iou}
    if like is not None:
        answering = {"nms_iou": like.nms_iou, "embed_normalize": like.embed_normalize}
    return InferenceEngine(loaded, backend, max_batch_size=8, max_inflight_batches=1,
                           **answering)  # fmt: skip


def probabilities(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int = 8
) -> torch.Tensor:
    """Every class's probability for every image, ``[images, classes]``, through the whole
    serving path (decode, resize, crop, collate, forward, softmax)."""
    rows: list[torch.Tensor] = []
    classes = engine.num_classes
    for prediction in served(engine, images, batch_size, top_k=classes):
        row = torch.zeros(classes)
        for entry in prediction.classes:
            row[entry["index"]] = entry["score"]
        rows.append(row)
    return torch.stack(rows)


def served(
    engine: InferenceEngine, images: Sequence[bytes], batch_size: int = 8, top_k: int = 1
) -> Iterator[Prediction]:
    """Each image's prediction through the whole serving path, in batches of ``batch_size``
    (or the engine's largest); an image that fails raises."""
    batch_size = min(batch_size, engine.max_batch_size)  # an engine takes no more than that
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        requests = [ImageRequest(engine.prepare(data), top_k) for data in chunk]
        for outcome in engine.run_batch(requests):
            if isinstance(outcome, BaseException):
                raise outcome
            yield outcome


def compare(
    reference: torch.Tensor, candidate: torch.Tensor, truth: Sequence[int] | None = None
) -> dict[str, Any]:
    """How closely the candidate's class probabilities follow the reference's, image by image
    (and, with the true classes, both sides' top-1 and top-5 accuracy)."""
    count = reference.shape[0]
    rows = torch.arange(count)
    k = min(5, reference.shape[1])
    ref_top = reference.topk(k, dim=1).indices
    cand_top = candidate.topk(k, dim=1).indices
    overlap = sum(
        len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(ref_top, cand_top, strict=True)
    )
    # The reference's top class is also the candidate's. An exact tie of two classes for first
    # counts (which of two equal classes a sort puts first is arbitrary); a candidate that
    # gives many classes the same top score has no answer at all, and agrees with nothing.
    # Where the reference itself has no answer (a model whose weights make every class equal,
    # as random ones can) there is no top class to agree on: only the probabilities compare.
    at_top = _at_top(candidate)
    answers = at_top.sum(dim=1) <= 2
    answered = _at_top(reference).sum(dim=1) <= 2
    same_top1 = at_top.gather(1, ref_top[:, :1]).squeeze(1) & answers
    best = reference.topk(min(2, reference.shape[1]), dim=1).values
    runner_up = best[:, 1] if best.shape[1] > 1 else torch.zeros(count)
    confident = (best[:, 0] >= CONFIDENT) & (best[:, 0] >= 2 * runner_up)
    plausible = (reference[rows, cand_top[:, 0]] >= PLAUSIBLE * best[:, 0]) & answers
    report: dict[str, Any] = {
        "images": count,
        "answered_images": int(answered.sum()),
        "top1_agreement": _share(same_top1, answered),
        "plausible_top1": _share(plausible, answered),
        "confident_images": int(confident.sum()),
        "confident_top1_agreement": (
            float(same_top1[confident].float().mean()) if confident.any() else 1.0
        ),
        "top5_overlap": overlap / count,
        "mean_total_variation": float(0.5 * (reference - candidate).abs().sum(dim=1).mean()),
        "max_probability_difference": float((reference - candidate).abs().max()),
        "labelled": truth is not None,
    }
    if truth is not None:
        labels = torch.tensor(list(truth))
        for name, top in (("reference", ref_top), ("candidate", cand_top)):
            report[f"{name}_top1"] = float((top[:, 0] == labels).float().mean())
            report[f"{name}_top5"] = float((top == labels[:, None]).any(dim=1).float().mean())
    return report


def _at_top(probabilities: torch.Tensor) -> torch.Tensor:
    """Per row, the classes that share its top score (more than two: no answer to speak of)."""
    return probabilities >= probabilities.max(dim=1, keepdim=True).values


def _share(hits: torch.Tensor, among: torch.Tensor) -> float:
    """The share of ``hits`` among the rows of ``among`` (1.0 when there are none)."""
    return float(hits[among].float().mean()) if among.any() else 1.0


# (figure, bound, what it is): a "min_" bound is a floor, a "max_" bound a ceiling.
_CHECKED = (
    ("top1_agreement", "min_top1_agreement", "top-1 agreement"),
    ("confident_top1_agreement", "min_confident_top1_agreement",
     "top-1 agreement where the reference is confident"),
    ("plausible_top1", "min_plausible_top1", "answers the reference finds plausible"),
    ("top5_overlap", "min_top5_overlap", "top-5 overlap"),
    ("mean_total_variation", "max_mean_total_variation", "mean total variation"),
    ("max_probability_difference", "max_probability_difference", "probability difference"),
)  # fmt: skip


def verdict(report: dict[str, Any], bounds: Bounds) -> list[str]:
    """The bounds the report misses (empty: it passes)."""
    failures = []
    for figure, name, what in _CHECKED:
        bound = getattr(bounds, name)
        value = report.get(figure)
        if not isinstance(value, int | float):
            failures.append(f"no {what} was measured")
        elif name.startswith("min_") and value < bound:
            failures.append(f"{what} {value:.4f} < {bound}")
        elif name.startswith("max_") and value > bound:
            failures.append(f"{what} {value:.4g} > {bound}")
    if report.get("labelled"):
        drop = report["reference_top1"] - report["candidate_top1"]
        if drop > bounds.max_top1_drop:
            failures.append(f"top-1 accuracy drops by {drop:.4f} > {bounds.max_top1_drop}")
    return failures


def judged(report: dict[str, Any], bounds: Bounds) -> dict[str, Any]:
    """The report with its bounds and verdict attached (what is stored and shown)."""
    failures = verdict(report, bounds)
    return {**report, "bounds": asdict(bounds), "passed": not failures, "failures": failures}

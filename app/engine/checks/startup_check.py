"""The start-up check: an engine against eager PyTorch in fp32 on the warm-up images, within
its precision's bounds, before it may serve. The verdict of a check that passed is kept beside
the artefact, bound to its sha256, the weights, the preprocessing, the runtime's version and
its options (threads, hints, optimisation level), the CPU's INT8 class, the precision, the
device, the bounds and the code: a later start that finds it serves without building the
eager model again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from app.engine.backends import Backend
from app.engine.checks.gate import CHECK_BOUNDS, compare, eager_reference, judged, probabilities
from app.engine.checks.task_check import (
    TASK_CHECK_BOUNDS,
    TASKS_CHECKED,
    answers,
    compare_task,
    judged_task,
)
from app.engine.device import cpu_supports_bf16
from app.engine.engine import InferenceEngine
from app.engine.errors import CheckFailedError
from app.engine.model.artifacts import keep_json
from app.engine.model.kept import read_kept
from app.engine.model.loading import LoadedModel, loaded_digest
from app.engine.warmup import warmup_images
from app.startup import Phases

logger = logging.getLogger("batchserve")

CHECK_RECORD = "startup-check.json"  # beside the artefact that serves


class CheckRecord(BaseModel):
    """A kept verdict, as it must read back."""

    bound_to: dict[str, Any]
    report: dict[str, Any]


def is_checked(backend: Backend) -> bool:
    """Whether a backend is checked against eager PyTorch in fp32 at start-up."""
    return checked_against_eager(backend.name, backend.precision, backend.device)


def checked_against_eager(name: str, precision: str, device: torch.device) -> bool:
    """A runtime always is; PyTorch itself in a precision below fp32, on a CPU or a GPU (bf16
    moved efficientnet-lite0's probabilities by up to 0.070 on the 20 test photos,
    ``benchmarks/results/accuracy-efficientnet-lite0-torchscript-bf16.md``; fp16 overflows
    where activations pass 65504, which no reading of the code can rule out)."""
    if name != "torch":
        return True
    return precision != "fp32"


def engine_check(
    engine: InferenceEngine, loaded: LoadedModel, device: torch.device, phases: Phases
) -> dict[str, Any]:
    """The start-up check of an engine: the verdict kept beside its artefact, or run now (and
    kept when it passes, if an artefact serves). Raises ``CheckFailedError`` when it fails,
    unless the engine serves an INT8 model that failed its gate (``ALLOW_UNGATED_INT8``):
    then the failure is only reported."""
    gate = engine.backend.int8_gate
    ungated = gate is not None and not gate["passed"]
    artifact: Path | None = getattr(engine.backend, "path", None)
    with phases.phase("check"):
        record = artifact.parent / CHECK_RECORD if artifact is not None else None
        bound_to = json_ready(check_binding(engine, loaded, device)) if record else None
        report = kept_check(record, bound_to) if record is not None else None
        if report is None:
            # No backend converts the loaded module in place (a precision below fp32 has its
            # own copy): it is still the eager fp32 model the check compares with.
            reference = copy.deepcopy(loaded.module).eval().float()
            report = startup_check(engine, loaded, reference, enforce=not ungated)
            if report["passed"] and record is not None:
                keep_json(record, {"bound_to": bound_to, "report": report})
    return report


def check_binding(engine: InferenceEngine, loaded: LoadedModel, device: torch.device) -> Any:
    """What a start-up check's verdict holds for: this artefact (its sha256), these weights and
    preprocessing, this runtime version and CPU INT8 class, this precision and device, these
    bounds."""
    from app.engine.int8.int8_report import binding

    path = Path(engine.backend.path)  # type: ignore[attr-defined]
    bound = {
        **binding(loaded, loaded_digest(loaded), path, engine.backend.name),
        "precision": engine.precision, "device": device.type,
        "bounds": dataclasses.asdict(bounds_of(engine)),
        "options": engine.backend.options(),
    }  # fmt: skip
    if engine.precision == "bf16":  # native kernels and their emulation round differently
        bound["native_bf16"] = cpu_supports_bf16()
    return bound


def bounds_of(engine: InferenceEngine) -> Any:
    """The bounds an engine's start-up check holds it to: its task's, in its precision."""
    table = TASK_CHECK_BOUNDS if engine.task in TASKS_CHECKED else CHECK_BOUNDS
    return table[engine.precision]


def kept_check(record: Path, bound_to: Any) -> dict[str, Any] | None:
    """The verdict of an earlier start-up check of this very artefact here (``record`` holds
    it, bound to what ``check_binding`` says), if there is one: a later start serves without
    running eager PyTorch beside it again."""
    kept = read_kept(record, CheckRecord, "start-up check")
    if kept is None or kept.bound_to != bound_to or not kept.report.get("passed"):
        return None
    logger.info("the start-up check of this artefact passed before (%s)", record)
    return {**kept.report, "reused": True}


def json_ready(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def startup_check(
    engine: InferenceEngine,
    loaded: LoadedModel,
    reference_module: torch.nn.Module,
    *,
    enforce: bool = True,
) -> dict[str, Any]:
    """Compare the engine with eager fp32 PyTorch on the warm-up images; raise outside the
    tolerance of the engine's precision (no fallback: the operator asked for this backend).
    Not ``enforce``d for an INT8 model served without a passing gate (``ALLOW_UNGATED_INT8``):
    its answers were accepted as they are, so a failure is only logged."""
    reference_engine = eager_reference(loaded, reference_module, like=engine)
    images = list(warmup_images())
    if engine.task in TASKS_CHECKED:
        report = judged_task(
            engine.task,
            compare_task(engine.task, answers(reference_engine, images), answers(engine, images)),
            bounds_of(engine),
        )
    else:
        report = judged(
            compare(probabilities(reference_engine, images), probabilities(engine, images)),
            bounds_of(engine),
        )
    report["against"] = "eager PyTorch fp32 on the warm-up images"
    if not report["passed"] and not enforce:
        logger.critical(
            "%s (%s) disagrees with eager PyTorch (%s): served anyway, ungated",
            engine.backend.name, engine.precision, "; ".join(report["failures"]),
        )  # fmt: skip
        return report
    if not report["passed"]:
        if engine.precision in ("bf16", "fp16"):
            remedy = f"This model loses too much in {engine.precision}: serve it in fp32"
        else:
            remedy = ("The artefact may be broken: remove it to export it again "
                      f"({getattr(engine.backend, 'path', '')})")  # fmt: skip
        raise CheckFailedError(
            f"{engine.backend.name} ({engine.precision}) disagrees with eager PyTorch fp32: "
            f"{'; '.join(report['failures'])}. {remedy}"
        )
    figures = {key: value for key, value in report.items()
               if key.startswith(("top1_agreement", "max_probability", "min_", "mean_pixel",
                                  "mean_cosine", "box_"))}  # fmt: skip
    logger.info("%s %s agrees with eager PyTorch: %s", engine.backend.name, engine.precision,
                ", ".join(f"{key} {_shown(value)}" for key, value in figures.items()))  # fmt: skip
    return report


def _shown(value: Any) -> str:
    """A figure of the check, or why there is none (no box on either side to find)."""
    return "none to judge" if value is None else f"{value:.4g}"

"""Which INT8 model may serve here: the one its accuracy report says passed, if that report
holds for what is served (``int8_report``), else judged again now on the held-out images kept
beside it, and never one that fails unless ``ALLOW_UNGATED_INT8`` says so. Built on the INT8
build (``quantize``), which is built on the artefacts (``store``)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.engine.checks.boxes import INSTANCE_FIGURES
from app.engine.checks.gate import eager_reference, engine_for
from app.engine.checks.precision import Rate, images_per_second
from app.engine.checks.task_gate import figure_names, gate_answers, gate_compare
from app.engine.errors import UngatedModelError
from app.engine.int8.int8_class import this_cpu
from app.engine.int8.int8_report import (
    GATE_IMAGES,
    Int8Bounds,
    artifact_digest,
    binding,
    int8_bounds,
    int8_failures,
    reasons_to_rejudge,
)
from app.engine.int8.quantize import build_int8, runtime_backend
from app.engine.model.artifacts import REPORT, read_json
from app.engine.model.loading import LoadedModel, loaded_digest
from app.engine.model.store import int8_artifact, int8_key
from app.engine.tasks import server_nms
from app.model_config import ModelConfig

logger = logging.getLogger("batchserve")


def int8_ready(config: ModelConfig, loaded: LoadedModel) -> bool:
    """True when this backend's INT8 model exists and its accuracy gate passes here (nothing
    is built: what ``BACKEND=auto`` may choose with ``PRECISION=auto``)."""
    path = int8_artifact(config.artifacts_dir, loaded, config.backend)
    return path is not None and bool(judge_stored(config, loaded, path)["passed"])


def gated_int8(
    config: ModelConfig, loaded: LoadedModel, rate: Rate = images_per_second
) -> tuple[Path, dict[str, Any]]:
    """The INT8 artefact for this backend, only if its accuracy report holds here (see
    ``int8_report``), with what ``/v1/models`` shows of the report; ``rate`` measures speed
    where one is built now."""
    key = int8_key(loaded, config.backend)
    path = int8_artifact(config.artifacts_dir, loaded, config.backend)
    if config.calibration_dir is not None:  # built now unless made from these images
        path = build_int8(config, loaded, config.calibration_dir, rate=rate)
    if path is None:
        raise UngatedModelError(
            f"no INT8 model for {loaded.name} under {key.path(config.artifacts_dir)}: build "
            f"one with `python -m app.quantize --calibration DIR` (it runs the accuracy gate), "
            f"or set CALIBRATION_DIR to build it at start-up"
        )
    report_path = path.parent / REPORT
    summary = judge_stored(config, loaded, path)
    if not summary["failures"]:
        return path, summary
    why = "; ".join(summary["failures"])
    if not config.allow_ungated_int8:
        raise UngatedModelError(
            f"the INT8 model {path} did not pass its accuracy gate ({why}); see {report_path}. "
            f"ALLOW_UNGATED_INT8=true serves it anyway"
        )
    logger.critical(
        "\n%s\nSERVING AN INT8 MODEL THAT DID NOT PASS ITS ACCURACY GATE (%s; %s), because "
        "ALLOW_UNGATED_INT8=true. Its answers may be wrong.\n%s",
        "!" * 78, why, report_path, "!" * 78,
    )  # fmt: skip
    return path, summary


def judge_stored(config: ModelConfig, loaded: LoadedModel, path: Path) -> dict[str, Any]:
    """The verdict on the INT8 artefact at ``path`` under this start-up's config: from its
    report's figures when they are bound to what is served here, else from the gate run
    again on the held-out images stored beside it. What ``/v1/models`` shows of it."""
    bounds = int8_bounds(config, loaded.task)
    report = read_json(path.parent / REPORT)
    bound_to = binding(loaded, loaded_digest(loaded), path, config.backend, config.threads)
    reasons = reasons_to_rejudge(report, bound_to, bounds)
    if report is not None and not reasons:
        figures = report
    else:
        logger.warning("judging the INT8 model %s again: %s", path, "; ".join(reasons))
        figures = _rejudge(config, loaded, path, bounds, report)
    shown = _SHOWN if loaded.task == "classify" else _shown_for(bounds)
    # A box-only detector has no mask or keypoint figures: leave them out, not null.
    summary = {key: figures.get(key) for key in shown
               if key in figures or key not in INSTANCE_FIGURES}  # fmt: skip
    summary |= {"failures": int8_failures(figures, bounds), "judged_again": bool(reasons),
                "bounds": asdict(bounds), "cpu_int8_class": this_cpu().name}  # fmt: skip
    summary["passed"] = not summary["failures"]
    return summary


_SHOWN = (
    "recipe", "confident_top1_agreement", "plausible_top1", "mean_total_variation",
    "max_probability_difference", "top1_agreement", "top5_overlap", "images",
    "images_per_second", "fp32_images_per_second",
)  # fmt: skip


def _shown_for(bounds: Int8Bounds) -> tuple[str, ...]:
    """What ``/v1/models`` shows of a detector's, a segmenter's or an encoder's gate."""
    return ("recipe", *figure_names(bounds), "images", "images_per_second",
            "fp32_images_per_second")  # fmt: skip


def _rejudge(
    config: ModelConfig,
    loaded: LoadedModel,
    path: Path,
    bounds: Int8Bounds,
    report: dict[str, Any] | None,
) -> dict[str, Any]:
    stored = path.parent / GATE_IMAGES
    images = [item.read_bytes() for item in sorted(stored.iterdir())] if stored.is_dir() else []
    if len(images) < config.int8_gate_min_images:
        return {"failures": [
            f"its report cannot be used here and {len(images)} held-out images are stored "
            f"beside it (INT8_GATE_MIN_IMAGES={config.int8_gate_min_images}): build it again "
            f"with `python -m app.quantize --calibration DIR`"
        ]}  # fmt: skip
    backend = runtime_backend(config.backend, path, loaded, "int8", config.threads)
    nms_iou = server_nms(loaded.task, config.model, config.nms_iou)
    reference = gate_answers(eager_reference(loaded, nms_iou=nms_iou), images)
    candidate = gate_answers(engine_for(loaded, backend, nms_iou=nms_iou), images)
    figures = gate_compare(loaded.task, reference, candidate, bounds)
    # The speed measured when it was built, if the report is this artefact's.
    if report is not None and report.get("artifact_sha256") == artifact_digest(path):
        for key in ("recipe", "images_per_second", "fp32_images_per_second"):
            figures[key] = report.get(key)
    return figures

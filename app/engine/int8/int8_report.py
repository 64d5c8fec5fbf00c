"""An INT8 model's accuracy report, and when it may be believed.

The report stored beside an INT8 artefact holds the gate's figures and what they were measured
on: the artefact's digest, the model's weights, the preprocessing, the CPU's INT8 class, the
runtime's version and threads, and the code that judged. A start-up believes the figures only
when all of that matches what it is about to serve, and judges them by the bounds in its own
config, never by the stored ``passed`` alone. Anything else (the artefact was replaced, the
report belongs to another model or is unreadable, the artefact moved to a CPU whose INT8
arithmetic differs, the runtime or the code changed, or the config ask for stricter bounds
than those it was judged by) re-runs the gate on the held-out images stored beside the
artefact before the model may serve.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from app.engine.checks.boxes import INSTANCE_FIGURES
from app.engine.checks.gate import Bounds, looser, verdict
from app.engine.checks.task_gate import (
    DetectBounds,
    EmbedBounds,
    SegmentBounds,
    figure_names,
    task_verdict,
)
from app.engine.int8.int8_class import this_cpu
from app.engine.model.artifacts import file_sha256
from app.engine.model.kept import code_fingerprint
from app.engine.model.loading import LoadedModel
from app.model_config import ModelConfig

GATE_IMAGES = "gate"  # the folder of held-out images beside an INT8 artefact


def artifact_digest(path: Path) -> str:
    """sha256 of the model file (and of an OpenVINO IR's weights file beside it): the one
    ``digest_ahead`` began, if the files are as they were when it began."""
    with _ahead_lock:
        ahead = _ahead.pop(path, None)
    if ahead is not None:
        stamp, future = ahead
        # Failed (it is hashed again below, where the error is raised), or written since.
        if future.exception() is None and stamp == _stamp(path):
            return future.result()
    return _digest(path)


def digest_ahead(path: Path) -> None:
    """Begin hashing the artefact at ``path`` in a thread of its own, for the next
    ``artifact_digest(path)``. hashlib releases the GIL, and so does a runtime while it
    compiles: on a CPU the two run on different cores."""
    stamp = _stamp(path)
    future: Future[str] = Future()

    def run() -> None:
        try:
            future.set_result(_digest(path))
        except BaseException as exc:
            future.set_exception(exc)

    with _ahead_lock:
        _ahead[path] = (stamp, future)
    threading.Thread(target=run, name="artefact-digest", daemon=True).start()


_ahead: dict[Path, tuple[tuple[tuple[int, int], ...], Future[str]]] = {}
_ahead_lock = threading.Lock()


def _files(path: Path) -> list[Path]:
    weights = path.with_suffix(".bin")
    return [path, *([weights] if weights != path and weights.is_file() else [])]


def _digest(path: Path) -> str:
    return file_sha256(*_files(path))


def _stamp(path: Path) -> tuple[tuple[int, int], ...]:
    """Sizes and modification times: a file written again since has another."""
    return tuple((stat.st_size, stat.st_mtime_ns) for stat in map(Path.stat, _files(path)))


def preprocessing(loaded: LoadedModel) -> dict[str, Any]:
    return loaded.transform.as_dict()


def runtime_version(backend: str) -> str:
    if backend == "openvino":
        import openvino

        return f"openvino {openvino.get_version()}"
    if backend == "torch":
        import torch

        return f"torch {torch.__version__}"
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__}"


def binding(
    loaded: LoadedModel, weights_digest: str, path: Path, backend: str, threads: int | None = None
) -> dict[str, Any]:
    """What a report's figures are bound to (``threads``: the runtime's, where they count)."""
    bound: dict[str, Any] = {
        "model": loaded.name,
        "weights_digest": weights_digest,
        "artifact_sha256": artifact_digest(path),
        "preprocessing": preprocessing(loaded),
        "cpu_int8_class": this_cpu().name,
        "runtime": runtime_version(backend),
        "code": code_fingerprint(),
    }
    if threads is not None:
        bound["threads"] = threads
    return bound


_WHY = {
    "model": "it is another model's",
    "weights_digest": "it is for other weights",
    "artifact_sha256": "the artefact is not the one it judged",
    "preprocessing": "the preprocessing changed",
    "cpu_int8_class": "it was judged on a CPU of another INT8 class",
    "runtime": "it was judged with another runtime version",
    "code": "it was judged by other code (another version of batchserve)",
    "threads": "it was judged with the runtime on another number of threads",
}


def reasons_to_rejudge(
    report: dict[str, Any] | None, bound_to: dict[str, Any], bounds: Int8Bounds
) -> list[str]:
    """Why a stored report's figures cannot decide for this start-up (empty: they can)."""
    if report is None or not _readable(report, bounds):
        return ["there is no readable report"]
    reasons = [
        f"{_WHY[key]} ({report.get(key)!r}, here {value!r})"
        for key, value in bound_to.items()
        if report.get(key) != value
    ]
    stricter = looser(report.get("bounds") or {}, bounds)
    if stricter:
        reasons.append(f"the config ask for stricter bounds ({', '.join(stricter)})")
    return reasons


_FIGURES = ("confident_top1_agreement", "plausible_top1", "mean_total_variation",
            "max_probability_difference", "top1_agreement")  # fmt: skip

Int8Bounds = Bounds | DetectBounds | SegmentBounds | EmbedBounds


def _readable(report: dict[str, Any], bounds: Int8Bounds) -> bool:
    """Whether a report holds what the gate judges by: its figures as numbers (a report of a
    build where no candidate was judged holds its failures instead)."""
    if "images" not in report:
        failures = report.get("failures")
        return isinstance(failures, list) and all(isinstance(each, str) for each in failures)
    if isinstance(bounds, Bounds):
        return all(_number(report.get(key)) for key in _FIGURES)
    # A task's figure may be None: not measured (no box found), which its verdict fails; a
    # detector's masks and keypoints are figures only of one that answers them.
    return all(key in report and (report[key] is None or _number(report[key]))
               for key in figure_names(bounds) if key not in INSTANCE_FIGURES)  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def gate_verdict(report: dict[str, Any], bounds: Int8Bounds) -> list[str]:
    """The bounds a report's figures miss, in its task's terms."""
    return verdict(report, bounds) if isinstance(bounds, Bounds) else task_verdict(report, bounds)


def int8_failures(report: dict[str, Any], bounds: Int8Bounds) -> list[str]:
    """The gate's verdict on a report's figures under ``bounds``, and the speed rule: an INT8
    model that runs slower than fp32 on the same runtime is not served."""
    if "images" not in report:  # no candidate was ever judged
        return list(report.get("failures") or ["no INT8 model was judged"])
    failures = gate_verdict(report, bounds)
    rate, fp32 = report.get("images_per_second"), report.get("fp32_images_per_second")
    if isinstance(rate, int | float) and isinstance(fp32, int | float) and rate < fp32:
        failures.append(f"slower than fp32 ({rate:.1f} < {fp32:.1f} images/s)")
    return failures


def int8_bounds(config: ModelConfig, task: str = "classify") -> Int8Bounds:
    """The gate's bounds for a model of ``task``, from the config (``INT8_GATE_*``)."""
    if task == "detect":
        return DetectBounds(
            confident_score=config.int8_gate_confident_score,
            min_confident_boxes=config.int8_gate_min_confident_boxes,
            min_box_recall=config.int8_gate_min_box_recall,
            min_box_precision=config.int8_gate_min_box_precision,
            min_matched_iou=config.int8_gate_min_matched_iou,
            min_mask_iou=config.int8_gate_min_mask_iou,
            min_keypoint_pck=config.int8_gate_min_keypoint_pck,
        )
    if task == "segment":
        return SegmentBounds(
            min_worst_pixel_agreement=config.int8_gate_min_worst_pixel_agreement,
            min_mean_iou=config.int8_gate_min_mean_iou,
        )
    if task == "embed":
        return EmbedBounds(
            min_mean_cosine=config.int8_gate_min_mean_cosine,
            min_worst_cosine=config.int8_gate_min_worst_cosine,
            min_neighbour_agreement=config.int8_gate_min_neighbour_agreement,
        )
    return Bounds(
        min_confident_top1_agreement=config.int8_gate_min_confident_top1_agreement,
        min_plausible_top1=config.int8_gate_min_plausible_top1,
        max_mean_total_variation=config.int8_gate_max_mean_total_variation,
        max_probability_difference=config.int8_gate_max_probability_difference,
    )

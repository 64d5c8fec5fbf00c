"""INT8 for detectors, segmenters and encoders: built on the runtimes, judged by a gate in the
task's own terms (fp32's confident boxes found again; masks' pixel agreement and mean IoU;
vectors' cosines and nearest neighbours), and never served when the gate fails."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.engine import build_engine
from app.engine.checks.gate import looser
from app.engine.checks.task_gate import (
    DetectBounds,
    EmbedBounds,
    SegmentBounds,
    compare_answers,
    task_verdict,
)
from app.engine.errors import StartupError, UngatedModelError
from app.engine.int8.int8_class import this_cpu
from app.engine.int8.int8_report import reasons_to_rejudge
from app.engine.machine import fixed_rates
from app.engine.model.artifacts import REPORT, read_json
from app.engine.tasks.answers import Detected
from app.settings import Settings
from tests import images
from tests.conftest import make_settings, serve
from tests.test_detector_runtimes import detected, with_masks

SEGMENTER = "tests.models:conv_segmenter"
ENCODER = "tests.models:conv_encoder"
DETECTOR = "tests.models:conv_grid_detector"
MODELS = {"detect": DETECTOR, "segment": SEGMENTER, "embed": ENCODER}

DETECT_BOUNDS = DetectBounds(confident_score=0.5, min_confident_boxes=3, min_box_recall=0.9,
                             min_box_precision=0.9, min_matched_iou=0.85)  # fmt: skip


def test_a_detector_is_judged_by_fp32s_confident_boxes_found_again() -> None:
    reference = [detected((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.7, 2)),
                 detected((0, 0, 20, 20, 0.8, 1), (50, 50, 60, 60, 0.3, 1))]  # fmt: skip
    candidate = [detected((0, 0, 10, 10, 0.9, 1), (22, 20, 32, 30, 0.7, 2)),  # moved 2 pixels
                 detected((0, 0, 20, 20, 0.8, 1))]  # fmt: skip
    figures = compare_answers("detect", reference, candidate, confident_score=0.5)
    # The unconfident box is not judged: three confident boxes, every one found.
    assert figures["confident_boxes"] == 3
    assert figures["box_recall"] == figures["box_precision"] == 1.0
    assert figures["matched_iou"] == pytest.approx((1 + 80 / 120 + 1) / 3)
    assert not task_verdict(figures, DETECT_BOUNDS)
    stricter = DetectBounds(**(asdict(DETECT_BOUNDS) | {"min_matched_iou": 0.9}))
    assert task_verdict(figures, stricter) == ["matched iou 0.8889 < 0.9"]
    # A confident box lost: recall falls; one INT8 invents: precision falls.
    lost = [detected((0, 0, 10, 10, 0.9, 1)), candidate[1]]
    invented = [candidate[0], detected((0, 0, 20, 20, 0.8, 1), (70, 70, 90, 90, 0.9, 3))]
    assert compare_answers("detect", reference, lost)["box_recall"] == pytest.approx(2 / 3)
    assert compare_answers("detect", reference, invented)["box_precision"] == pytest.approx(3 / 4)


def test_an_int8_detector_is_judged_by_its_masks_and_keypoints_where_it_answers_them() -> None:
    bounds = DetectBounds(**(asdict(DETECT_BOUNDS) | {"min_mask_iou": 0.75,
                                                      "min_keypoint_pck": 0.8}))  # fmt: skip
    boxes = detected((0, 0, 40, 40, 0.9, 1), (20, 20, 60, 60, 0.8, 2), (0, 40, 20, 60, 0.7, 1))
    rectangles = [(0, 0, 40, 40), (20, 20, 60, 60), (0, 40, 20, 60)]
    reference = [with_masks(boxes, rectangles)]
    assert not task_verdict(compare_answers("detect", reference, reference), bounds)
    shrunk = [with_masks(boxes, [(0, 0, 20, 20), (20, 20, 40, 40), (0, 40, 10, 50)])]
    figures = compare_answers("detect", reference, shrunk)
    assert figures["mask_iou"] == pytest.approx(0.25)
    assert task_verdict(figures, bounds) == ["mask iou 0.2500 < 0.75"]
    # Keypoints: a third of them moved off.
    points = np.repeat(np.array([[[10.0, 10.0, 1.0]] * 3]), 3, axis=0)
    moved = points.copy()
    moved[:, 0, :2] += 20
    pose = [Detected(boxes.boxes, boxes.scores, boxes.labels, keypoints=points)]
    off = [Detected(boxes.boxes, boxes.scores, boxes.labels, keypoints=moved)]
    figures = compare_answers("detect", pose, off)
    assert figures["keypoint_pck"] == pytest.approx(2 / 3)
    assert task_verdict(figures, bounds) == ["keypoint pck 0.6667 < 0.8"]
    # Boxes alone: not judged by masks or keypoints it does not answer, and its stored report
    # decides the next start-up without them.
    plain = compare_answers("detect", [boxes], [boxes])
    assert not task_verdict(plain, bounds)
    assert reasons_to_rejudge(plain | {"bounds": asdict(bounds)}, {}, bounds) == []


def test_too_few_confident_boxes_to_judge_is_a_refusal_never_a_pass() -> None:
    reference = [detected((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.4, 2))]
    figures = compare_answers("detect", reference, reference, confident_score=0.5)
    assert (figures["box_recall"], figures["box_precision"], figures["matched_iou"]) == (1, 1, 1)
    (failure,) = task_verdict(figures, DETECT_BOUNDS)
    assert failure == "too few confident boxes to judge (1 < 3, scoring at least 0.5)"
    nothing = compare_answers("detect", [detected()], [detected()], confident_score=0.5)
    assert task_verdict(nothing, DETECT_BOUNDS) == [
        "too few confident boxes to judge (0 < 3, scoring at least 0.5)"
    ]


def test_a_report_judged_from_another_confident_score_is_judged_again() -> None:
    judged_by = {"confident_score": 0.5, "min_confident_boxes": 3, "min_box_recall": 0.9,
                 "min_box_precision": 0.9, "min_matched_iou": 0.85, "min_mask_iou": 0.0,
                 "min_keypoint_pck": 0.0}  # fmt: skip
    assert looser(judged_by, DETECT_BOUNDS) == []
    # A report judged before masks and keypoints had bounds is judged anew.
    older = {name: bound for name, bound in judged_by.items() if "mask" not in name}
    assert looser(older, DETECT_BOUNDS) == ["min_mask_iou"]
    for score in (0.4, 0.6):  # neither floor nor ceiling: any other value judges anew
        other = DetectBounds(**(judged_by | {"confident_score": score}))  # type: ignore[arg-type]
        assert looser(judged_by, other) == ["confident_score"]


def test_a_mask_that_loses_a_small_class_agrees_on_pixels_and_fails_on_mean_iou() -> None:
    reference = np.zeros((10, 10), dtype=np.uint8)
    reference[4:6, 4:6] = 2
    candidate = np.zeros_like(reference)  # the small class gone
    figures = compare_answers("segment", [reference, reference], [reference, candidate])
    assert figures["worst_pixel_agreement"] == 0.96
    assert figures["classes_seen"] == 2
    assert figures["mean_iou"] == pytest.approx((192 / 196 + 4 / 8) / 2)
    bounds = SegmentBounds(min_worst_pixel_agreement=0.9, min_mean_iou=0.85)
    (failure,) = task_verdict(figures, bounds)
    assert failure.startswith("mean iou 0.7398 < 0.85")
    assert not task_verdict(compare_answers("segment", [reference], [reference]), bounds)


def at(*degrees: float) -> list[np.ndarray[Any, Any]]:
    return [np.array([math.cos(math.radians(d)), math.sin(math.radians(d))]) for d in degrees]


def test_vectors_close_in_cosine_can_still_change_their_nearest_neighbours() -> None:
    # 0, 2 and 5 degrees: the middle one's nearest is the first; moved to 3 degrees, the last.
    figures = compare_answers("embed", at(0, 2, 5), at(0, 3, 5))
    assert figures["worst_cosine"] == pytest.approx(math.cos(math.radians(1)))
    assert figures["neighbour_agreement"] == pytest.approx(2 / 3)
    bounds = EmbedBounds(min_mean_cosine=0.98, min_worst_cosine=0.95, min_neighbour_agreement=0.9)
    (failure,) = task_verdict(figures, bounds)
    assert failure.startswith("neighbour agreement 0.6667 < 0.9")
    # Lengths do not count (the server may normalise or not); a missing figure fails.
    assert not task_verdict(compare_answers("embed", at(0, 2, 5), [3 * v for v in at(0, 2, 5)]),
                            bounds)  # fmt: skip
    assert "no neighbour agreement was measured" in task_verdict(
        compare_answers("embed", at(0), at(0)), bounds
    )


def photo_folder(tmp_path: Path, count: int = 10) -> Path:
    folder = tmp_path / "calibration"
    folder.mkdir(exist_ok=True)
    for seed in range(count):
        (folder / f"{seed:02d}.jpg").write_bytes(images.jpeg(images.photo(240, 180, seed=seed)))
    return folder


# Passing bounds the test models meet with room on every CPU class: what is under test is
# that these figures judge, not how good INT8 is on a model of fixed filters.
ROOMY = {"int8_gate_min_worst_pixel_agreement": 0.8, "int8_gate_min_mean_iou": 0.8,
         "int8_gate_min_mean_cosine": 0.95, "int8_gate_min_worst_cosine": 0.9,
         "int8_gate_min_neighbour_agreement": 0.6, "int8_gate_min_box_recall": 0.8,
         "int8_gate_min_box_precision": 0.8, "int8_gate_min_matched_iou": 0.8}  # fmt: skip


# INT8 runs faster than fp32 here whatever the CPU: the gate judged by these tests is the
# accuracy one (on a CPU without VNNI, such as an AVX2-only one, these small models run INT8
# slower than fp32, and the speed rule alone would refuse them; that rule has its own test).
INT8_FASTER = fixed_rates(lambda backend: 100.0 if backend.precision == "int8" else 10.0)


def built_gated(settings: Settings) -> None:
    """The INT8 artefact and its gate report made, speed measured by ``INT8_FASTER``."""
    build_engine(settings.own_model(), machine=INT8_FASTER)


def task_settings(tmp_path: Path, task: str, backend: str, **overrides: Any) -> Settings:
    values = {"model": MODELS[task], "task": task, "backend": backend, "precision": "int8",
              "image_size": 224, "artifacts_dir": tmp_path / "artifacts", **ROOMY}  # fmt: skip
    return make_settings(**(values | overrides))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize(
    ("task", "figures", "impossible"),
    [
        ("detect", {"confident_boxes", "box_recall", "box_precision", "matched_iou"},
         {"int8_gate_min_matched_iou": 1.0}),
        ("segment", {"worst_pixel_agreement", "mean_iou"},
         {"int8_gate_min_mean_iou": 1.0, "int8_gate_min_worst_pixel_agreement": 1.0}),
        ("embed", {"mean_cosine", "worst_cosine", "neighbour_agreement"},
         {"int8_gate_min_worst_cosine": 1.0}),
    ],
)  # fmt: skip
async def test_int8_serves_a_task_only_behind_its_own_gate(
    tmp_path: Path, backend: str, task: str, figures: set[str], impossible: dict[str, float]
) -> None:
    settings = task_settings(tmp_path, task, backend, calibration_dir=photo_folder(tmp_path))
    built_gated(settings)
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        answer = await client.post("/predict", content=images.jpeg(images.photo(300, 200)),
                                   headers={"content-type": "image/jpeg"})  # fmt: skip
    assert (model["backend"]["name"], model["precision"]) == (backend, "int8")
    gate = model["backend"]["int8_gate"]
    assert gate["passed"], gate
    assert figures <= set(gate)
    assert all(0 < gate[name] <= 1 for name in figures - {"confident_boxes"})
    # A box-only detector's gate carries the mask and keypoint floors but judges neither.
    instance = {"min_mask_iou", "min_keypoint_pck"} if task == "detect" else set()
    floors = {f"min_{name}" for name in figures} | instance
    assert set(gate["bounds"]) - {"confident_score"} == floors
    assert not {"mask_iou", "keypoint_pck"} & set(gate)
    assert "top1_agreement" not in gate
    report = read_json(Path(model["backend"]["artifact"]).parent / REPORT)
    assert report is not None
    assert report["passed"]
    assert report["images"] == 30
    # OpenVINO's accuracy control measures class probabilities: the plain recipe alone.
    bits = 7 if this_cpu().saturates else 8
    tried = [each["recipe"] for each in report["recipes"]]
    assert tried[0] == ("nncf" if backend == "openvino" else "qdq") + f"-w{bits}"
    assert not any(name.endswith("accuracy-control") for name in tried)
    if task == "detect":
        assert gate["confident_boxes"] >= 20
        found = answer.json()["detections"]
        assert found
        assert all(0 <= box["box"][0] < box["box"][2] <= 300 for box in found)
    elif task == "segment":
        mask = Image.open(io.BytesIO(base64.b64decode(answer.json()["mask"])))
        assert mask.size == (300, 200)
    else:
        assert answer.json()["dim"] == 256

    # Bounds no INT8 model meets: stricter than the report's, so judged again, and refused.
    with pytest.raises(UngatedModelError, match="did not pass its accuracy gate"):
        build_engine(task_settings(tmp_path, task, backend, **impossible).own_model())


@pytest.mark.parametrize("task", ["segment", "detect"])
def test_auto_lets_a_gated_int8_model_of_a_task_compete(tmp_path: Path, task: str) -> None:
    settings = task_settings(tmp_path, task, "onnxruntime",
                             calibration_dir=photo_folder(tmp_path))  # fmt: skip
    built_gated(settings)
    auto = task_settings(tmp_path, task, "auto", precision="auto")
    engine = build_engine(auto.own_model(), machine=INT8_FASTER)
    assert (engine.backend.name, engine.precision) == ("onnxruntime", "int8")
    assert "onnxruntime int8" in engine.backend.describe()["auto"]["rates"]


def test_accuracy_control_is_refused_for_a_segmenter(tmp_path: Path) -> None:
    from app.engine.factory import load_configured_model
    from app.engine.int8.quantize import build_int8

    config = task_settings(tmp_path, "segment", "openvino").own_model()
    with pytest.raises(StartupError, match="accuracy control measures class probabilities"):
        build_int8(config, load_configured_model(config), photo_folder(tmp_path),
                   recipe="nncf-w8-accuracy-control")  # fmt: skip


def test_a_detector_confident_of_too_little_is_refused_int8(tmp_path: Path) -> None:
    # The grid detector is confident of some 600 boxes on the gate images; ask for more.
    settings = task_settings(tmp_path, "detect", "onnxruntime",
                             calibration_dir=photo_folder(tmp_path),
                             int8_gate_min_confident_boxes=100_000)  # fmt: skip
    with pytest.raises(UngatedModelError, match="too few confident boxes to judge"):
        build_engine(settings.own_model())
    report = read_json(next((tmp_path / "artifacts").glob("*int8*/report.json")))
    assert report is not None
    assert not report["passed"]
    assert report["box_recall"] > 0.8  # INT8 found fp32's boxes, yet there were too few
    assert len(report["recipes"]) == 1  # no recipe could pass: none after the first is tried


@pytest.mark.parametrize(
    ("model", "backend", "precision", "why"),
    [
        (DETECTOR, "torch", "fp16", "TASK=detect is served in fp32, bf16 or int8 on a CPU"),
        ("tests.models:bright_list_detector", "onnxruntime", "int8", "a list of boxes"),
    ],
)
def test_what_a_detector_cannot_be_served_in_stops_start_up_in_a_line(
    tmp_path: Path, model: str, backend: str, precision: str, why: str
) -> None:
    settings = task_settings(tmp_path, "detect", backend, model=model, precision=precision,
                             calibration_dir=photo_folder(tmp_path))  # fmt: skip
    with pytest.raises(StartupError, match=why) as raised:
        build_engine(settings.own_model())
    assert "\n" not in str(raised.value)

"""Detectors on ONNX Runtime and OpenVINO: SSD's backbone and heads exported with its anchors
and detections in PyTorch, a model returning padded boxes exported whole, each checked
against eager PyTorch in boxes at start-up; and how boxes are matched."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from app.engine import build_engine
from app.engine.checks.boxes import compare_detections
from app.engine.checks.gate import served
from app.engine.checks.startup_check import CHECK_RECORD
from app.engine.errors import CheckFailedError, StartupError
from app.engine.model.export import ONNX_FILE, OPENVINO_FILE, export_onnx
from app.engine.tasks.answers import Detected
from tests import images
from tests.conftest import make_settings
from tests.models import BrightBoxDetector

SIZE = 64


def detected(*rows: tuple[float, float, float, float, float, int]) -> Detected:
    """Boxes from ``(x1, y1, x2, y2, score, label)`` rows."""
    table = np.array(rows, dtype=np.float64).reshape(-1, 6)
    return Detected(table[:, :4], table[:, 4], table[:, 5].astype(np.int64))


def test_boxes_are_found_by_label_and_overlap_and_near_misses_in_score_are_no_misses() -> None:
    reference = [detected((0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.6, 2),
                          (40, 40, 50, 50, 0.8, 1))]  # fmt: skip
    candidate = [detected((1, 0, 11, 10, 0.85, 1),  # moved a pixel: IoU 0.82, found
                          (20, 20, 30, 30, 0.45, 2),  # same box, a little below 0.5
                          (40, 40, 50, 50, 0.8, 3))]  # another label: not a match  # fmt: skip
    figures = compare_detections(reference, candidate, min_score=0.5)
    assert figures["reference_boxes"] == 3
    assert figures["box_recall"] == pytest.approx(2 / 3)
    assert figures["candidate_boxes"] == 2  # 0.45 is not judged on its own side
    assert figures["box_precision"] == pytest.approx(1 / 2)
    assert figures["matched_iou"] == pytest.approx((90 / 110 + 1) / 2)
    assert figures["max_score_difference"] == pytest.approx(0.15)


def test_boxes_that_tie_with_the_last_one_served_are_not_held_against_either_side() -> None:
    # Six boxes of the same score, three served on each side, other ones: rounding's choice.
    ties = [(10.0 * i, 0, 10.0 * i + 8, 8, 0.25, 1) for i in range(6)]
    figures = compare_detections([detected(*ties[:3])], [detected(*ties[3:])], tie=1e-3)
    assert figures["tied_boxes"] == 6
    assert figures["box_recall"] is None  # nothing left to judge: no miss
    strict = compare_detections([detected(*ties[:3])], [detected(*ties[3:])])
    assert strict["box_recall"] == strict["box_precision"] == 0.0


def test_a_runtime_that_keeps_only_its_best_boxes_fails_the_start_up_check() -> None:
    """Only a true tie at the cut is excused: boxes that score below the last one the other
    side served, by more than the tie, are misses."""
    from app.engine.checks.task_check import CHECK_TIE, TASK_CHECK_BOUNDS, judged_task

    rows = [(10.0 * i, 0, 10.0 * i + 8, 8, 0.9 - 0.01 * i, 1) for i in range(50)]
    reference, best_three = detected(*rows), detected(*rows[:3])
    figures = compare_detections([reference], [best_three], tie=CHECK_TIE)
    assert figures["tied_boxes"] == 0
    assert figures["box_recall"] == pytest.approx(3 / 50)
    verdict = judged_task("detect", figures, TASK_CHECK_BOUNDS["fp32"])
    assert not verdict["passed"]
    assert verdict["failures"] == ["box_recall 0.060000 < 0.95"]
    # A box that ties with the cut is the other side's rounding, not a miss.
    tied = detected(*rows[:3], (500, 0, 508, 8, 0.87 + 1e-4, 1))
    figures = compare_detections([detected(*rows[:3], rows[3])], [tied], tie=CHECK_TIE)
    assert figures["tied_boxes"] == 2
    assert figures["box_recall"] == 1.0


def test_boxes_flattened_at_the_images_edge_match_only_their_own_corners() -> None:
    flat = detected((600, 768, 1000, 768, 0.2, 1))  # past the bottom edge, clipped
    same = detected((600.2, 768, 1000.3, 768, 0.2, 1))
    elsewhere = detected((100, 768, 300, 768, 0.2, 1))
    assert compare_detections([flat], [same])["box_recall"] == 1.0
    assert compare_detections([flat], [elsewhere])["box_recall"] == 0.0


def test_a_detector_answering_a_list_per_image_is_served_by_pytorch_alone(tmp_path: Path) -> None:
    model = "tests.models:bright_list_detector"
    settings = make_settings(model=model, task="detect", image_size=SIZE, backend="onnxruntime",
                             artifacts_dir=tmp_path)  # fmt: skip
    with pytest.raises(StartupError, match=r"served by BACKEND=torch .* a list of boxes per image"):
        build_engine(settings.own_model())
    auto = make_settings(model=model, task="detect", image_size=SIZE, backend="auto",
                         artifacts_dir=tmp_path)  # fmt: skip
    engine = build_engine(auto.own_model())
    assert engine.backend.name == "torch"
    assert "a list of boxes per image" in engine.backend.describe()["auto"]["reason"]


class Shifted(nn.Module):
    """The bright box detector with every box moved by half the input: a broken export."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        boxes, scores, labels = BrightBoxDetector()(x)
        return boxes + SIZE / 2, scores, labels


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_an_exported_detector_that_answers_other_boxes_stops_start_up(
    tmp_path: Path, backend: str
) -> None:
    settings = make_settings(model="tests.models:bright_box_detector", task="detect",
                             image_size=SIZE, backend=backend, artifacts_dir=tmp_path)  # fmt: skip
    build_engine(settings.own_model())
    for folder in list(tmp_path.iterdir()):
        if (folder / OPENVINO_FILE).is_file():
            shutil.rmtree(folder)  # converted again, from the ONNX export below
        elif (folder / ONNX_FILE).is_file():
            (folder / CHECK_RECORD).unlink(missing_ok=True)  # the good export's verdict
            export_onnx(Shifted(), (3, SIZE, SIZE), folder / ONNX_FILE,
                        ("boxes", "scores", "labels"))  # fmt: skip
    with pytest.raises(CheckFailedError, match=r"box_recall 0\.000000 < 0\.95"):
        build_engine(settings.own_model())


def test_a_runtime_detector_that_finds_nothing_passes_its_check_with_nothing_to_judge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(model="tests.models:blind_detector", task="detect",
                             image_size=SIZE, backend="onnxruntime",
                             artifacts_dir=tmp_path)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="batchserve"):
        engine = build_engine(settings.own_model())
    assert engine.backend.name == "onnxruntime"
    assert "box_recall none to judge" in caplog.text


def test_a_two_stage_detector_in_two_parts_answers_as_it_does_whole() -> None:
    """Faster R-CNN's backbone and feature pyramid (``RcnnGraph``, what a runtime runs) and
    the rest on their feature maps (``RcnnDecode``) answer the boxes the model answers whole,
    on torchvision's own random initialisation (scores spread enough to give boxes)."""
    from typing import Any

    from torchvision.models import get_model

    from app.engine.model.loading import load_model
    from app.engine.tasks.adapters import detector_parts
    from app.engine.tasks.outputs import detections

    name = "fasterrcnn_mobilenet_v3_large_320_fpn"
    loaded = load_model(name, "none", image_size=320)
    served_model: Any = loaded.module.eval()
    reference: Any = get_model(name, weights=None, weights_backbone=None)
    served_model.model.load_state_dict(reference.state_dict())
    served_model.model.roi_heads.score_thresh = 0.0  # every proposal's best classes answer
    parts = detector_parts(served_model, (320, 320))
    assert parts is not None
    assert parts.outputs == ("features_0", "features_1", "features_pool")
    batch = torch.randn(2, 3, 320, 320, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = detections(served_model(batch))
        split = parts.decode(parts.graph(batch), (320, 320), None)
    assert int((whole.scores > 0).sum()) > 50
    for got, want in zip(split, whole, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("model", "backend", "size"),
    [
        ("tests.models:resnet18_faster_rcnn", "onnxruntime", 256),
        ("tests.models:resnet18_faster_rcnn", "openvino", 256),
    ],
)
def test_faster_rcnn_is_served_by_a_runtime_with_its_box_head_there_too(
    tmp_path: Path, model: str, backend: str, size: int
) -> None:
    """The backbone and, on what PyTorch proposes, the RoI pooling, box head and predictors
    (from one pyramid level, or from four by the proposals' sizes) run on the runtime, and
    answer the boxes eager PyTorch does, judged by the start-up check on more than a hundred
    boxes. The ResNet-18 model is the judge: its random boxes follow its features closely
    enough that pooling from the wrong level or at the wrong scale fails its check (the
    MobileNetV3 one people serve, whose random boxes barely move, is held to torchvision's own
    answers on every runtime by the fidelity tests)."""
    settings = make_settings(model=model, task="detect", image_size=size, backend=backend,
                             artifacts_dir=tmp_path)  # fmt: skip
    engine = build_engine(settings.own_model())
    assert (engine.backend.name, engine.precision) == (backend, "fp32")
    assert "box-head" in engine.backend.describe()["box_head"]
    check = engine.check
    assert check is not None
    assert check["passed"], check
    assert check["reference_boxes"] > 100
    # Not all but one: the runtime's backbone differs from PyTorch's by float rounding, which
    # moves some of a random model's proposals, and so the boxes regressed from them.
    assert check["matched_iou"] > 0.98
    # What is left to torch (the proposals, the suppression) is light: it keeps one thread
    # beside the runtime's.
    assert engine.torch_threads == 1
    (answer,) = served(engine, [images.jpeg(images.photo(400, 300))])
    assert answer.detected is not None


def test_a_box_head_pools_each_proposal_from_its_own_pyramid_level() -> None:
    """The decoding's own pooling (``LevelPooling``) and ``RcnnBoxHead`` in PyTorch, in place
    of ``roi_heads``' pooling and heads, answer what the model answers whole: on a ResNet-18
    pyramid, whose proposals are pooled from four levels by their size."""
    from app.engine.model.loading import load_model
    from app.engine.tasks.adapters import DetectorDecoding, detector_parts
    from app.engine.tasks.outputs import detections
    from app.engine.tasks.rcnn import RcnnDecode

    loaded = load_model("tests.models:resnet18_faster_rcnn", "none", image_size=256, task="detect")
    parts = detector_parts(loaded.module, (256, 256))
    assert parts is not None
    assert parts.box_head is not None
    assert isinstance(parts.decode, DetectorDecoding)
    pooled = parts.decode.decoder((256, 256))
    assert isinstance(pooled, RcnnDecode)
    assert len(pooled.pooling.maps) == 4
    box_head = parts.box_head
    decode = parts.decode.with_box_head(lambda inputs: box_head(*inputs))
    batch = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = detections(loaded.module(batch))
        split = decode(parts.graph(batch), (256, 256), None)
    assert int((whole.scores > 0).sum()) > 50
    for got, want in zip(split, whole, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("model", ["resnet18_retinanet", "resnet18_fcos"])
def test_a_dense_detector_in_two_parts_answers_as_it_does_whole(model: str) -> None:
    """RetinaNet's and FCOS's backbone, pyramid and heads (``DenseGraph``, what a runtime
    runs) and their anchors and detections on the heads' outputs (``DenseDecode``) answer the
    boxes the model answers whole."""
    from app.engine.model.loading import load_model
    from app.engine.tasks.adapters import detector_parts
    from app.engine.tasks.outputs import detections

    loaded = load_model(f"tests.models:{model}", "none", image_size=256, task="detect")
    parts = detector_parts(loaded.module, (256, 256))
    assert parts is not None
    batch = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = detections(loaded.module(batch))
        split = parts.decode(parts.graph(batch), (256, 256), None)
    assert int((whole.scores > 0).sum()) >= 200
    for got, want in zip(split, whole, strict=True):
        torch.testing.assert_close(got, want)


def with_masks(found: Detected, boxes: list[tuple[int, int, int, int]]) -> Detected:
    """``found`` with each box's mask: the rectangle ``(x1, y1, x2, y2)`` in a 64x64 image."""
    from pycocotools import mask as coco

    masks = []
    for x1, y1, x2, y2 in boxes:
        pixels = np.zeros((64, 64, 1), dtype=np.uint8, order="F")
        pixels[y1:y2, x1:x2] = 1
        (encoded,) = coco.encode(pixels)
        masks.append({"size": [64, 64], "counts": encoded["counts"].decode("ascii")})
    return Detected(found.boxes, found.scores, found.labels, masks=masks)


def test_a_runtime_whose_masks_or_keypoints_drift_fails_the_start_up_check() -> None:
    """The boxes alone agree; the masks and keypoints of the found boxes are judged too, where
    the reference answers them, and a side that answers none of them scores nothing."""
    from app.engine.checks.task_check import CHECK_TIE, TASK_CHECK_BOUNDS, judged_task

    bounds = TASK_CHECK_BOUNDS["fp32"]
    boxes = detected((0, 0, 40, 40, 0.9, 1), (20, 20, 60, 60, 0.8, 2))
    reference = with_masks(boxes, [(0, 0, 40, 40), (20, 20, 60, 60)])
    same = with_masks(boxes, [(0, 0, 40, 40), (20, 20, 60, 60)])
    shrunk = with_masks(boxes, [(0, 0, 40, 40), (20, 20, 40, 40)])  # a quarter of the second
    figures = compare_detections([reference], [same], tie=CHECK_TIE)
    assert figures["mask_iou"] == 1.0
    assert judged_task("detect", figures, bounds)["passed"]
    figures = compare_detections([reference], [shrunk], tie=CHECK_TIE)
    assert figures["mask_iou"] == pytest.approx((1 + 0.25) / 2)
    assert judged_task("detect", figures, bounds)["failures"] == ["mask_iou 0.625000 < 0.9"]
    figures = compare_detections([reference], [boxes], tie=CHECK_TIE)
    assert figures["mask_iou"] == 0.0

    points = np.zeros((2, 3, 3))
    points[0, :, :2] = [[5, 5], [10, 10], [20, 30]]
    points[1, :, :2] = [[25, 25], [30, 30], [50, 50]]
    moved = points.copy()
    moved[1, 2, :2] += 5  # more than a tenth of the box's 40 pixels
    keypoints = Detected(boxes.boxes, boxes.scores, boxes.labels, keypoints=points)
    drifted = Detected(boxes.boxes, boxes.scores, boxes.labels, keypoints=moved)
    figures = compare_detections([keypoints], [drifted], tie=CHECK_TIE)
    assert figures["keypoint_pck"] == pytest.approx(5 / 6)
    assert figures["keypoint_distance"] == pytest.approx(np.hypot(5, 5) / 6)
    assert judged_task("detect", figures, bounds)["failures"] == ["keypoint_pck 0.833333 < 0.9"]
    assert compare_detections([keypoints], [boxes])["keypoint_pck"] == 0.0
    # A detector without masks or keypoints is judged by its boxes alone.
    figures = compare_detections([boxes], [boxes], tie=CHECK_TIE)
    assert "mask_iou" not in figures
    assert "keypoint_pck" not in figures
    assert judged_task("detect", figures, bounds)["bounds"] == {
        "min_box_recall": 0.95, "min_box_precision": 0.95
    }  # fmt: skip

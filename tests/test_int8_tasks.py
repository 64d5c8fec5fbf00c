"""INT8 for segmenters and encoders: built on the runtimes, judged by a gate in the task's own
terms (masks' pixel agreement and mean IoU; vectors' cosines and nearest neighbours), and
never served when the gate fails."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.engine import build_engine
from app.engine.checks.task_gate import (
    EmbedBounds,
    SegmentBounds,
    compare_answers,
    task_verdict,
)
from app.engine.errors import StartupError, UngatedModelError
from app.engine.int8.int8_class import this_cpu
from app.engine.machine import fixed_rates
from app.engine.model.artifacts import REPORT, read_json
from app.settings import Settings
from tests import images
from tests.conftest import make_settings, serve

SEGMENTER = "tests.models:conv_segmenter"
ENCODER = "tests.models:conv_encoder"


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
         "int8_gate_min_neighbour_agreement": 0.6}  # fmt: skip


def task_settings(tmp_path: Path, task: str, backend: str, **overrides: Any) -> Settings:
    model = SEGMENTER if task == "segment" else ENCODER
    values = {"model": model, "task": task, "backend": backend, "precision": "int8",
              "image_size": 224, "artifacts_dir": tmp_path / "artifacts", **ROOMY}  # fmt: skip
    return make_settings(**(values | overrides))


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize(
    ("task", "figures", "impossible"),
    [
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
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        answer = await client.post("/predict", content=images.jpeg(images.photo(300, 200)),
                                   headers={"content-type": "image/jpeg"})  # fmt: skip
    assert (model["backend"]["name"], model["precision"]) == (backend, "int8")
    gate = model["backend"]["int8_gate"]
    assert gate["passed"], gate
    assert figures <= set(gate)
    assert all(0 < gate[name] <= 1 for name in figures)
    assert set(gate["bounds"]) == {f"min_{name}" for name in figures}
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
    if task == "segment":
        mask = Image.open(io.BytesIO(base64.b64decode(answer.json()["mask"])))
        assert mask.size == (300, 200)
    else:
        assert answer.json()["dim"] == 256

    # Bounds no INT8 model meets: stricter than the report's, so judged again, and refused.
    with pytest.raises(UngatedModelError, match="did not pass its accuracy gate"):
        build_engine(task_settings(tmp_path, task, backend, **impossible).own_model())


def test_auto_lets_a_gated_int8_segmenter_compete(tmp_path: Path) -> None:
    settings = task_settings(tmp_path, "segment", "onnxruntime",
                             calibration_dir=photo_folder(tmp_path))  # fmt: skip
    build_engine(settings.own_model())
    machine = fixed_rates(lambda backend: 100.0 if backend.precision == "int8" else 10.0)
    auto = task_settings(tmp_path, "segment", "auto", precision="auto")
    engine = build_engine(auto.own_model(), machine=machine)
    assert (engine.backend.name, engine.precision) == ("onnxruntime", "int8")
    assert "onnxruntime int8" in engine.backend.describe()["auto"]["rates"]


def test_accuracy_control_is_refused_for_a_segmenter(tmp_path: Path) -> None:
    from app.engine.factory import load_configured_model
    from app.engine.int8.quantize import build_int8

    config = task_settings(tmp_path, "segment", "openvino").own_model()
    with pytest.raises(StartupError, match="accuracy control measures class probabilities"):
        build_int8(config, load_configured_model(config), photo_folder(tmp_path),
                   recipe="nncf-w8-accuracy-control")  # fmt: skip

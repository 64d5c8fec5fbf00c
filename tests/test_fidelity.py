"""Served with the same weights, a model answers what its own library answers.

For every torchvision detection and segmentation family (``tests.fidelity``), on every backend
it runs on: weights whose answers spread, saved as a checkpoint and served from it; real
photos of five shapes, two of each, sent together so that equal shapes share batches; the
answers against torchvision's own single-image eager pipeline on the same photos.

What is compared, and the bounds:

- boxes: of the reference's confident boxes (scoring at least 0.5), the share the server
  answers (same label, IoU >= 0.5: recall), and of the server's, the share the reference
  answers (precision), with the matched boxes' mean IoU; an instance segmenter's masks by
  the mean IoU of matched masks, a keypoint detector's keypoints by their mean distance. A
  box without area is no box: the server never answers one (FCOS's regression, through a
  ReLU, gives torchvision some), so the reference's are left out;
- masks: the share of each photo's pixels given the reference's class (its worst photo).

PyTorch computes what torchvision computes: the bounds leave room only for a batch's kernels
rounding otherwise than one image's. A runtime computes the same function in its own
arithmetic: its bounds leave room for the boxes and pixels that rounding moves.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.engine.checks.task_gate import compare_answers
from app.engine.tasks.answers import Detected
from preprocessing import TransformConfig
from tests import fidelity
from tests.checks import metric
from tests.conftest import make_settings, serve

BACKENDS = ("torch", "onnxruntime", "openvino")
BOUNDS = {
    "torch": {"box_recall": 0.99, "box_precision": 0.99, "matched_iou": 0.99, "mask_iou": 0.99,
              "pixels": 0.99},
    "runtime": {"box_recall": 0.9, "box_precision": 0.9, "matched_iou": 0.95, "mask_iou": 0.9,
                "pixels": 0.97},
}  # fmt: skip
# A keypoint moves with its box: at most this many pixels on average.
KEYPOINT_DISTANCE = {"torch": 0.5, "runtime": 3.0}


@pytest.fixture(scope="session")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the tests' checkpoints and artefacts: a family's export is made once for
    both runtimes."""
    return tmp_path_factory.mktemp("fidelity")


_REFERENCES: dict[str, list[Any]] = {}


def reference_answers(name: str, weights: Path) -> list[Any]:
    """The family's own pipeline's answers (once per session), boxes with an area only."""
    if name not in _REFERENCES:
        found = fidelity.reference_answers(name, weights)
        _REFERENCES[name] = [with_area(each) for each in found] if isinstance(
            found[0], Detected) else found  # fmt: skip
    return _REFERENCES[name]


def with_area(found: Detected) -> Detected:
    """The detections whose boxes have an area."""
    keep = (found.boxes[:, 2] > found.boxes[:, 0]) & (found.boxes[:, 3] > found.boxes[:, 1])
    masks = [m for m, kept in zip(found.masks, keep, strict=True) if kept] if found.masks else None
    keypoints = found.keypoints[keep] if found.keypoints is not None else None
    return Detected(found.boxes[keep], found.scores[keep], found.labels[keep], masks, keypoints)


def served_answer(task: str, body: dict[str, Any]) -> Any:
    """``/predict``'s JSON as the comparison reads it."""
    if task == "segment":
        png = Image.open(io.BytesIO(base64.b64decode(body["mask"])))
        return np.asarray(png).astype(np.int64)
    found = body["detections"]
    masks = [each["mask"] for each in found] if found and "mask" in found[0] else None
    points = [each["keypoints"] for each in found] if found and "keypoints" in found[0] else None
    return Detected(
        np.array([each["box"] for each in found], dtype=np.float32).reshape(-1, 4),
        np.array([each["score"] for each in found], dtype=np.float32),
        np.array([each["index"] for each in found], dtype=np.int64), masks,
        np.array(points, dtype=np.float32) if points is not None else None,
    )  # fmt: skip


def measured(text: str, name: str) -> float:
    """``metric``, 0 where the sample is not there yet."""
    return metric(text, name) if name.split("{")[0] + "{" + name.split("{")[1][:-1] in text else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [family.name for family in fidelity.FAMILIES])
async def test_served_answers_are_the_libraries_own(name: str, backend: str, folder: Path) -> None:
    family = fidelity.FAMILY[name]
    if backend != "torch" and backend not in family.runtimes:
        pytest.skip(f"{name} does not run on {backend}")
    weights = fidelity.checkpoint(name, folder)
    expected = reference_answers(name, weights)
    settings = make_settings(
        model=family.model, task=family.task, weights=str(weights), backend=backend,
        artifacts_dir=folder / name, max_batch_size=8, dispatch_when_idle=False,
        max_queue_delay_ms=300, min_score=0.05, max_detections=300,
        request_timeout_ms=300_000, **family.settings,
    )  # fmt: skip
    photos = fidelity.photos()
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        before = (await client.get("/metrics")).text  # the start-up check's batches
        responses = await asyncio.gather(*(
            client.post("/predict", content=photo, headers={"content-type": "image/png"})
            for photo in photos
        ))  # fmt: skip
        text = (await client.get("/metrics")).text
    for response in responses:
        assert response.status_code == 200, response.text
    answers = [served_answer(family.task, response.json()) for response in responses]

    # Equal shapes shared their forward passes (at most 8 images each), and no other shape.
    transform = TransformConfig(**model["transform"])
    canvases = Counter(
        transform.placement(*Image.open(io.BytesIO(photo)).size).canvas for photo in photos
    )  # fmt: skip
    assert len(canvases) == (1 if transform.fit.fixed_canvas else fidelity.shapes())
    for (height, width), images in canvases.items():
        shape = f'{{canvas="{height}x{width}"}}'
        for part, expected_value in (("count", -(-images // 8)), ("sum", images)):
            name = f"batchserve_canvas_batch_size_{part}{shape}"
            assert measured(text, name) - measured(before, name) == expected_value, name

    bounds = BOUNDS["torch" if backend == "torch" else "runtime"]
    figures = compare_answers(family.task, expected, answers, confident_score=0.5)
    if family.task == "segment":
        assert figures["worst_pixel_agreement"] >= bounds["pixels"], figures
        return
    assert figures["confident_boxes"] >= 20, figures  # enough to judge by
    for figure in ("box_recall", "box_precision", "matched_iou"):
        assert figures[figure] >= bounds[figure], figures
    if name == "mask_rcnn":
        assert figures["mask_iou"] >= bounds["mask_iou"], figures
    if name == "keypoint_rcnn":
        limit = KEYPOINT_DISTANCE["torch" if backend == "torch" else "runtime"]
        assert figures["keypoint_distance"] <= limit, figures


@pytest.mark.slow
async def test_shared_canvases_batch_photos_of_different_shapes_together(folder: Path) -> None:
    """``CANVAS_BUCKETS``: photos of four shapes padded into two canvases (each into the
    smallest that holds it) share forward passes, each told its own size (every box in its
    photo); a photo whose own canvas is its bucket answers as it does alone, and one that no
    bucket holds (the wide strip) keeps its own canvas."""
    family = fidelity.FAMILY["faster_rcnn"]
    weights = fidelity.checkpoint("faster_rcnn", folder)
    expected = reference_answers("faster_rcnn", weights)
    settings = make_settings(
        model=family.model, task=family.task, weights=str(weights), backend="torch",
        artifacts_dir=folder / "faster_rcnn", max_batch_size=8, dispatch_when_idle=False,
        max_queue_delay_ms=300, min_score=0.05, max_detections=300,
        request_timeout_ms=300_000, canvas_buckets="480x320,320x512", **family.settings,
    )  # fmt: skip
    photos = fidelity.photos()
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        before = (await client.get("/metrics")).text
        responses = await asyncio.gather(*(
            client.post("/predict", content=photo, headers={"content-type": "image/png"})
            for photo in photos
        ))  # fmt: skip
        text = (await client.get("/metrics")).text
    transform = TransformConfig(**model["transform"])
    assert transform.buckets == ((320, 512), (480, 320))
    sizes = [Image.open(io.BytesIO(photo)).size for photo in photos]
    own = [replace(transform, buckets=()).placement(*size).canvas for size in sizes]
    assert len(set(own)) == fidelity.shapes()  # five shapes alone, two canvases shared
    shared = {"320x512": (4, 1), "480x320": (4, 1), "224x640": (2, 1)}
    for canvas, (images, passes) in shared.items():
        for part, value in (("sum", images), ("count", passes)):
            name = f'batchserve_canvas_batch_size_{part}{{canvas="{canvas}"}}'
            assert measured(text, name) - measured(before, name) == value, name

    answers = [served_answer(family.task, response.json()) for response in responses]
    assert sum(len(found) for found in answers) >= 10
    for (width, height), found in zip(sizes, answers, strict=True):
        assert (found.boxes[:, 2] > found.boxes[:, 0]).all()
        assert (found.boxes[:, 3] > found.boxes[:, 1]).all()
        assert (found.boxes >= 0).all()
        assert (found.boxes[:, [0, 2]] <= width).all()
        assert (found.boxes[:, [1, 3]] <= height).all()
    alone = [index for index, canvas in enumerate(own) if canvas == (320, 512)]
    assert alone  # the cat's canvas is its bucket
    figures = compare_answers(family.task, [expected[i] for i in alone],
                              [answers[i] for i in alone], confident_score=0.1)  # fmt: skip
    assert figures["confident_boxes"] >= 1, figures
    assert figures["box_recall"] >= BOUNDS["torch"]["box_recall"], figures
    assert figures["box_precision"] >= BOUNDS["torch"]["box_precision"], figures

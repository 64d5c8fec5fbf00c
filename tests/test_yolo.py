"""Ultralytics YOLO files served as Ultralytics' own ``predict`` answers them.

YOLO11n (and YOLO26n) detection, pose, segmentation and classification models built offline
from Ultralytics' YAMLs with spread weights (``harness.yolo``), served from their checkpoint
(and from TorchScript exports, YOLO26's end-to-end ones among them) with one setting,
``MODEL``; real photos of five shapes sent together (a checkpoint's each in its own minimum
rectangle, as Ultralytics letterboxes a lone photo; an export's of fixed shapes all in its
square) and their answers held to
``YOLO(file).predict(photo)`` photo by photo: the recall and precision of its
confident boxes (IoU >= 0.5, same class), their mean IoU, and the keypoints' distance. A
decoder that forgot the letterbox's centring would move every box of the non-square photos
by half their padding and fail.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.engine.checks.task_gate import compare_answers
from app.engine.factory import load_configured_model
from app.engine.model.loading import ModelLoadError, load_model
from harness import reference
from harness import yolo as yolo_models
from harness.photos import photos
from tests.conftest import make_settings, serve, served_photos
from tests.test_fidelity import served_answer

pytest.importorskip("ultralytics")

pytestmark = pytest.mark.slow
# PyTorch computes what Ultralytics computes; a runtime, in its own arithmetic, may move what
# rounding moves (the bounds of the torchvision families' fidelity tests).
BOUNDS = {
    "torch": {"box_recall": 0.99, "box_precision": 0.99, "matched_iou": 0.99},
    "runtime": {"box_recall": 0.9, "box_precision": 0.9, "matched_iou": 0.95},
}
KEYPOINT_DISTANCE = {"torch": 0.5, "runtime": 3.0}
# The same mask logits, resampled by another chain (this server brings the prototypes to the
# input's size, Ultralytics by the least factor that cuts the padding on whole pixels): edges
# move by a pixel here and there, which the small masks of these weights feel.
MASK_IOU = {"torch": 0.98, "runtime": 0.9}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("yolo")


def settings_for(path: Path, folder: Path, **overrides: Any) -> Any:
    return make_settings(
        model=str(path), artifacts_dir=folder / "artifacts", max_batch_size=8,
        dispatch_when_idle=False, max_queue_delay_ms=300, min_score=0.05, max_detections=300,
        request_timeout_ms=300_000, **overrides,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("task", "family", "export", "backend"),
    [("detect", "yolo11n", "", "torch"), ("pose", "yolo11n", "", "torch"),
     ("detect", "yolo11n", "torchscript", "auto"), ("detect", "yolo11n", "", "onnxruntime"),
     ("detect", "yolo11n", "", "openvino"), ("pose", "yolo11n", "", "onnxruntime"),
     ("pose", "yolo11n", "", "openvino"), ("segment", "yolo11n", "", "torch"),
     ("segment", "yolo11n", "", "onnxruntime"), ("segment", "yolo11n", "", "openvino"),
     # YOLO26: its checkpoint answers as its predictor's default (one-to-many branch and
     # suppression); exported with nms=False, its end-to-end head answers ready rows.
     ("detect", "yolo26n", "", "torch"), ("detect", "yolo26n", "end-to-end", "auto"),
     ("segment", "yolo26n", "end-to-end", "auto"), ("pose", "yolo26n", "end-to-end", "auto")],
)  # fmt: skip
async def test_a_yolo_file_answers_what_ultralytics_answers(
    task: str, family: str, export: str, backend: str, folder: Path
) -> None:
    checkpoint = yolo_models.checkpoint(task, folder, family=family)
    path = checkpoint
    if export:
        path = yolo_models.torchscript(task, folder, family, end_to_end=export == "end-to-end")
    model, bodies = await served_photos(settings_for(path, folder, backend=backend))
    # A runtime serves the network to its raw head; an export runs on PyTorch alone.
    assert model["backend"]["name"] == ("torch" if backend == "auto" else backend)
    assert model["task"] == "detect"
    assert model["model"] == path.stem  # the file's name without its suffix: URLs stay plain
    assert model["transform"]["fit"] == "centered-letterbox"
    answers = [served_answer("detect", body) for body in bodies]
    expected = reference.yolo_detected(str(path), photos(), retina_masks=True)

    figures = compare_answers("detect", expected, answers, confident_score=0.5)
    assert figures["confident_boxes"] >= 20, figures  # enough to judge by
    side = "runtime" if backend in ("onnxruntime", "openvino") else "torch"
    for figure, bound in BOUNDS[side].items():
        assert figures[figure] >= bound, figures
    if task == "pose":
        assert figures["keypoint_distance"] <= KEYPOINT_DISTANCE[side], figures
        assert all(len(each.keypoints[0]) == 17 for each in answers if len(each)), "17 points"
    if task == "segment":  # each box's mask in the image's pixels, as retina_masks gives it
        assert figures["mask_iou"] >= MASK_IOU[side], figures
        assert all(not len(each) or (each.masks is not None and len(each.masks) == len(each))
                   for each in answers)  # fmt: skip
    # The labels are the model's own names.
    assert {d["label"] for body in bodies for d in body["detections"]} <= set(
        _names(checkpoint).values()
    )


async def test_a_yolo_classifier_answers_ultralytics_probabilities(folder: Path) -> None:
    path = yolo_models.checkpoint("classify", folder)
    model, bodies = await served_photos(settings_for(path, folder, top_k=5))
    assert model["task"] == "classify"
    expected = reference.yolo_classified(str(path), photos())
    for body, probabilities in zip(bodies, expected, strict=True):
        best = body["predictions"][0]
        assert best["index"] == int(probabilities.argmax())
        assert best["score"] == pytest.approx(float(probabilities.max()), abs=1e-4)


def _names(path: Path) -> dict[int, str]:
    from ultralytics import YOLO

    names: dict[int, str] = YOLO(str(path)).names
    return names


def test_files_that_are_not_a_servable_yolo_model_stop_the_start(folder: Path) -> None:
    state = folder / "state_dict.pt"
    torch.save({"weight": torch.zeros(2)}, state)
    with pytest.raises(ModelLoadError, match="not an Ultralytics checkpoint"):
        load_model(str(state))
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(folder / "missing.pt"))
    bare = folder / "bare.torchscript"
    with warnings.catch_warnings():  # TorchScript is deprecated; Ultralytics still exports it
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(torch.nn.Identity()), str(bare))
    with pytest.raises(ModelLoadError, match="no Ultralytics metadata"):
        load_model(str(bare))
    rotated = yolo_models.checkpoint("obb", folder)
    with pytest.raises(ModelLoadError, match="YOLO obb: served are detect, pose, segment"):
        load_model(str(rotated))
    detector = yolo_models.checkpoint("detect", folder)
    with pytest.raises(ModelLoadError, match="served as TASK=detect, not segment"):
        load_model(str(detector), task="segment")
    export = yolo_models.torchscript("detect", folder)
    config = settings_for(export, folder, canvas_buckets="640x960").own_model()
    with pytest.raises(ModelLoadError, match="takes only its own canvas 640x640"):
        load_configured_model(config, use_card=False)


def test_the_letterbox_is_centred_as_ultralytics_centres_it() -> None:
    """Each photo's content lies where Ultralytics' ``LetterBox`` puts it: alone, in its
    minimum rectangle; in the shared square, where a batch of mixed sizes puts it."""
    from ultralytics.data.augment import LetterBox

    from app.engine.tasks.yolo import yolo_transform

    alone = yolo_transform(640, stride=32)
    shared = replace(alone, buckets=((640, 640),))
    for width, height in [(600, 400), (451, 300), (512, 512), (400, 600), (640, 200), (33, 1001)]:
        image = {"img": np.zeros((height, width, 3), dtype=np.uint8)}
        for transform, rect in ((alone, True), (shared, False)):
            params = LetterBox((640, 640), auto=rect, stride=32).get_params(dict(image))
            where = transform.placement(width, height)
            assert (where.content_width, where.content_height) == params["new_unpad"]
            assert (where.top, where.left) == (params["top"], params["left"])
            assert where.canvas == (
                params["top"] + params["new_unpad"][1] + params["bottom"],
                params["left"] + params["new_unpad"][0] + params["right"],
            )


async def test_a_yolo_pose_model_answers_the_same_over_the_protocol(folder: Path) -> None:
    """``boxes``, ``scores``, ``labels``, ``num_detections`` and ``keypoints [B, K, 17, 3]``,
    as ``/predict`` answers the same photos."""
    from tests.test_tasks import outputs_of, v2_body

    path = yolo_models.checkpoint("pose", folder)
    pictures = [photos()[0], photos()[4]]
    async with serve(settings_for(path, folder)) as (_, client):
        found = outputs_of(await client.post(f"/v2/models/{path.stem}/infer",
                                             content=v2_body(*pictures)))  # fmt: skip
        alone = [(await client.post("/predict", content=picture,
                                    headers={"content-type": "image/png"})).json()
                 for picture in pictures]  # fmt: skip
    counts = found["num_detections"]["data"]
    assert counts == [len(body["detections"]) for body in alone]
    most = max(counts)
    assert found["keypoints"]["shape"] == [2, most, 17, 3]
    points = np.array(found["keypoints"]["data"], dtype=np.float32).reshape(2, most, 17, 3)
    for row, body in enumerate(alone):
        expected = np.array([each["keypoints"] for each in body["detections"]], dtype=np.float32)
        np.testing.assert_allclose(points[row, : counts[row]], expected, atol=1e-3)

"""Hugging Face transformers models served as the library's own pipeline answers them: a
directory ``save_pretrained`` wrote (``MODEL=./my-model``) or ``MODEL=hf:<repo>``.

Small configurations of real architectures (ViT and ConvNeXt classifiers, DINOv2 and CLIP's and
SigLIP's vision towers as encoders, DETR, Conditional and Deformable DETR, RT-DETR and D-FINE
detectors, SegFormer, UperNet and DPT segmenters) built offline with spread
heads and saved with their image processor (``harness.hf_models``), served through the real
start-up path, real photos of five shapes sent together, and held photo by photo to the image
processor, the model and the processor's own post-processing on Pillow's image: the same top
classes and probabilities, vectors, confident boxes and mask pixels. Each family prepares
images its own way (stretched bilinear, ConvNeXt's crop fraction with bicubic, a floored
centre crop, DETR's shortest and longest edges, unnormalised RT-DETR), and SegFormer's
quarter-resolution logits are resized to the image before their arg-max; a server that did any
of these otherwise would answer otherwise.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.engine import build_engine
from app.engine.checks.task_gate import compare_answers
from app.engine.errors import StartupError, UngatedModelError
from app.engine.model.artifacts import REPORT, read_json
from app.engine.model.hf_models import HfModelError, load_hf
from app.engine.model.loading import ModelLoadError, load_model
from app.engine.model.store import ensure_onnx
from harness import hf_models
from harness.photos import photos
from preprocessing.transforms import Interpolation
from tests.conftest import make_settings, served_photos
from tests.test_fidelity import served_answer
from tests.test_int8_tasks import photo_folder

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
# PyTorch computes what transformers computes; a runtime in its own arithmetic.
PROBABILITY = {"torch": 1e-4, "onnxruntime": 2e-3, "openvino": 2e-3}
COSINE = {"torch": 0.9999, "onnxruntime": 0.999, "openvino": 0.999}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


def settings_for(family: str, folder: Path, **overrides: Any) -> Any:
    return make_settings(
        model=str(hf_models.saved(family, folder)), artifacts_dir=folder / "artifacts",
        max_batch_size=8, dispatch_when_idle=False, max_queue_delay_ms=300,
        request_timeout_ms=300_000, **overrides,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("family", "backend"),
    [("vit", "torch"), ("vit", "onnxruntime"), ("vit", "openvino"), ("convnext", "torch"),
     ("convnext", "onnxruntime")],
)  # fmt: skip
async def test_a_classifier_answers_what_transformers_answers(
    family: str, backend: str, folder: Path
) -> None:
    model, bodies = await served_photos(settings_for(family, folder, backend=backend, top_k=5))
    assert model["backend"]["name"] == backend
    assert model["task"] == "classify"
    expected = hf_models.classified(hf_models.saved(family, folder), photos())
    spread = [float(np.sort(each)[-1] - np.sort(each)[-2]) for each in expected]
    assert max(spread) > 0.05, "the weights tell classes apart"
    for body, probabilities in zip(bodies, expected, strict=True):
        top = np.argsort(-probabilities)[:5]
        assert [p["index"] for p in body["predictions"]] == top.tolist()
        assert body["predictions"][0]["label"] == f"class {top[0]}"  # id2label's
        served = np.array([p["score"] for p in body["predictions"]])
        np.testing.assert_allclose(served, probabilities[top], atol=PROBABILITY[backend])


@pytest.mark.parametrize(("family", "backend"), [("dinov2", "torch"), ("clip", "torch"),
                                                 ("dinov2", "onnxruntime"),
                                                 ("siglip", "torch")])  # fmt: skip
async def test_an_encoder_answers_its_image_vector(family: str, backend: str, folder: Path) -> None:
    model, bodies = await served_photos(settings_for(family, folder, backend=backend,
                                                     task="embed"))  # fmt: skip
    assert model["task"] == "embed"
    expected = np.stack(hf_models.embedded(hf_models.saved(family, folder), photos()))
    served = np.stack([np.array(body["embedding"]) for body in bodies])
    figures = compare_answers("embed", list(expected), list(served))
    assert figures["worst_cosine"] >= COSINE[backend], figures
    # The photos' vectors differ: a comparison of near-equal vectors would judge nothing.
    unit = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    assert float((unit @ unit.T).min()) < 0.99


@pytest.mark.parametrize(("family", "backend"), [("detr", "torch"), ("rt_detr", "torch"),
                                                 ("conditional_detr", "torch"),
                                                 ("deformable_detr", "torch"),
                                                 ("d_fine", "torch"),
                                                 ("detr", "onnxruntime"),
                                                 ("conditional_detr", "openvino")])  # fmt: skip
async def test_a_detector_answers_its_processors_boxes(
    family: str, backend: str, folder: Path
) -> None:
    settings = settings_for(family, folder, backend=backend, min_score=0.05, max_detections=300)
    model, bodies = await served_photos(settings)
    assert model["task"] == "detect"
    answers = [served_answer("detect", body) for body in bodies]
    expected = hf_models.detected(hf_models.saved(family, folder), photos(), threshold=0.05)
    figures = compare_answers("detect", expected, answers, confident_score=0.3)
    assert figures["confident_boxes"] >= 20, figures
    bound = 0.99 if backend == "torch" else 0.9
    for figure in ("box_recall", "box_precision", "matched_iou"):
        assert figures[figure] >= bound, figures


@pytest.mark.parametrize(("family", "backend"), [("segformer", "torch"),
                                                 ("segformer", "onnxruntime"),
                                                 ("upernet", "torch"),
                                                 ("dpt", "torch")])  # fmt: skip
async def test_a_segmenter_answers_its_processors_mask(
    family: str, backend: str, folder: Path
) -> None:
    model, bodies = await served_photos(settings_for(family, folder, backend=backend))
    assert model["task"] == "segment"
    answers = [served_answer("segment", body) for body in bodies]
    expected = hf_models.segmented(hf_models.saved(family, folder), photos())
    figures = compare_answers("segment", expected, answers)
    assert figures["classes_seen"] >= 3, figures
    assert figures["worst_pixel_agreement"] >= (0.999 if backend == "torch" else 0.99), figures


def test_the_image_processors_rule_is_the_servers_transform(folder: Path) -> None:
    vit = load_hf(str(hf_models.saved("vit", folder))).transform
    assert (vit.fit, vit.crop_size, vit.interpolation) == ("stretch", 224, "bilinear")
    assert vit.mean == (0.5, 0.5, 0.5)
    convnext = load_hf(str(hf_models.saved("convnext", folder))).transform
    # ConvNeXt's crop_pct: the shorter side to int(224 / 0.875), the centre 224, floored.
    assert (convnext.fit, convnext.resize_size, convnext.crop_size) == ("center-crop", 256, 224)
    assert convnext.crop_floor
    assert convnext.interpolation == "bicubic"
    detr = load_hf(str(hf_models.saved("detr", folder))).transform
    assert (detr.fit, detr.resize_size, detr.max_size) == ("shortest-longest", 480, 800)
    # A 2:1 panorama passes the longest edge: 800 x round(800 * 300 / 600).
    assert detr.placement(600, 300).content == (400, 800)
    rt_detr = load_hf(str(hf_models.saved("rt_detr", folder))).transform
    assert (rt_detr.mean, rt_detr.std) == ((0.0,) * 3, (1.0,) * 3)  # do_normalize false


def test_a_server_resizing_otherwise_answers_otherwise(folder: Path) -> None:
    """The comparison can fail: ConvNeXt's probabilities with bilinear for its bicubic, and
    with torchvision's rounded crop for its floored one, move past the bound."""
    from preprocessing import normalize_into, prepare

    directory = hf_models.saved("convnext", folder)
    loaded = load_model(str(directory))
    expected = hf_models.classified(directory, photos())

    def worst(transform: Any) -> float:
        gaps = []
        for data, probabilities in zip(photos(), expected, strict=True):
            image = prepare(data, transform)
            batch = np.zeros((1, 3, *image.canvas), dtype=np.float32)
            import torch

            tensor = torch.from_numpy(batch)
            assert image.pixels is not None
            normalize_into([image.pixels], tensor, transform, [image.placement])
            with torch.inference_mode():
                served = loaded.module(tensor).softmax(-1)[0].numpy()
            gaps.append(float(np.abs(served - probabilities).max()))
        return max(gaps)

    assert worst(loaded.transform) < PROBABILITY["torch"]
    bilinear = replace(loaded.transform, interpolation=Interpolation.BILINEAR)
    assert worst(bilinear) > PROBABILITY["torch"]
    assert worst(replace(loaded.transform, crop_floor=False)) > PROBABILITY["torch"]


@pytest.mark.parametrize(
    ("family", "task", "backend", "figure"),
    [("vit", "classify", "openvino", "confident_top1_agreement"),
     ("detr", "detect", "openvino", "box_recall"),
     ("dinov2", "embed", "onnxruntime", "worst_cosine")],
)  # fmt: skip
def test_int8_of_a_transformers_model_is_judged_by_its_tasks_gate(
    family: str, task: str, backend: str, figure: str, folder: Path, tmp_path: Path
) -> None:
    """Quantised from its own export and calibrated on photos, then served only where the
    gate in its task's terms passes (which, with random weights and this CPU's INT8 speed,
    it may not): either way the verdict is the task's, and nothing else is served."""
    settings = settings_for(family, folder, backend=backend, precision="int8", task=task,
                            calibration_dir=photo_folder(tmp_path, 12))  # fmt: skip
    refusal = ""
    try:
        served: str | None = build_engine(settings.own_model()).precision
    except UngatedModelError as exc:
        served, refusal = None, str(exc)
    assert "\n" not in refusal  # a refusal is one line naming the figures it failed
    (path,) = settings.own_model().artifacts_dir.glob(f"*{family}*int8*/{REPORT}")
    report = read_json(path)
    assert report is not None
    assert figure in report
    assert served == ("int8" if report["passed"] else None)


def test_what_cannot_be_served_stops_the_start(folder: Path, tmp_path: Path) -> None:
    vit = hf_models.saved("vit", folder)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((vit / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"no preprocessor_config\.json"):
        load_model(str(bare))
    with pytest.raises(ModelLoadError, match="served as TASK=classify, not detect"):
        load_model(str(vit), task="detect")
    with pytest.raises(ModelLoadError, match="IMAGE_SIZE"):
        load_model(str(vit), image_size=256)
    with pytest.raises(HfModelError, match="not in the Hugging Face cache"):
        load_hf("hf-internal-testing/not-a-model-anywhere")
    # RT-DETR's code fixes the batch in any export (``len()`` of a batch tensor): refused on a
    # runtime with one line, served on PyTorch.
    rt_detr = load_model(str(hf_models.saved("rt_detr", folder)))
    with pytest.raises(StartupError, match="only with a fixed batch of 2"):
        ensure_onnx(tmp_path / "artifacts", rt_detr)
    # Deformable DETR's export fixes the canvas it was traced at; D-FINE's does not convert
    # (an operator the exporter lacks): each refused in one line, BACKEND=torch serving it.
    for family, why in (
        ("deformable_detr", "only with a fixed height x width of"),
        ("d_fine", r"does not export to ONNX \(DispatchError: No ONNX function"),
    ):
        with pytest.raises(StartupError, match=why) as raised:
            ensure_onnx(tmp_path / "artifacts", load_model(str(hf_models.saved(family, folder))))
        assert "\n" not in str(raised.value)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"architectures": ["NoSuchModelForImageClassification"]}')
    (odd / "preprocessor_config.json").write_text((vit / "preprocessor_config.json").read_text())
    with pytest.raises(ModelLoadError):
        load_model(str(odd))
    # DPT's depth checkpoints keep the aspect ratio (to a multiple of 32): not a fixed square.
    depth = tmp_path / "depth"
    shutil.copytree(hf_models.saved("dpt", folder), depth)
    config = json.loads((depth / "preprocessor_config.json").read_text())
    (depth / "preprocessor_config.json").write_text(
        json.dumps(config | {"keep_aspect_ratio": True, "ensure_multiple_of": 32})
    )
    with pytest.raises(ModelLoadError, match="keeps the aspect ratio"):
        load_model(str(depth))

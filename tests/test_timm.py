"""timm models served as timm's own pipeline answers them: ``MODEL=timm:<name>``.

Small timm architectures built offline (``create_model(name, pretrained=False)`` from a fixed
seed, the classifier spread so that classes differ, saved as a checkpoint: ``harness.timm``),
served through the real start-up path with ``WEIGHTS=<checkpoint>``, real photos of five
shapes sent together, and held photo by photo to timm's own ``create_transform`` of its
``resolve_model_data_config`` and the model on Pillow's image: the same top classes and
probabilities, the same pre-logits features. Models of each of timm's preparations are here:
bicubic with a 0.95 crop (ConvNeXt, ViT), bilinear (ResNet), squashed to the square
(ConvNeXt-V2 at 384); a server that resized otherwise would answer other probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.engine.model.loading import ModelLoadError, load_model
from app.engine.model.timm_models import TimmModelError, timm_transform
from harness import timm_models
from harness.photos import photos
from tests.conftest import make_settings, served_photos

pytest.importorskip("timm")

pytestmark = pytest.mark.slow
# PyTorch computes what timm computes; a runtime in its own arithmetic.
PROBABILITY = {"torch": 1e-4, "onnxruntime": 2e-3, "openvino": 2e-3}
COSINE = {"torch": 0.9999, "onnxruntime": 0.999, "openvino": 0.999}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("timm")


def settings_for(name: str, folder: Path, **overrides: Any) -> Any:
    return make_settings(
        model=f"timm:{name}", weights=str(timm_models.checkpoint(name, folder)),
        artifacts_dir=folder / "artifacts", max_batch_size=8, dispatch_when_idle=False,
        max_queue_delay_ms=300, request_timeout_ms=300_000, **overrides,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "backend"),
    [("test_convnext.r160_in1k", "torch"), ("test_convnext.r160_in1k", "onnxruntime"),
     ("test_convnext.r160_in1k", "openvino"), ("test_resnet.r160_in1k", "torch"),
     ("test_vit.r160_in1k", "torch"), ("test_vit.r160_in1k", "onnxruntime"),
     ("convnextv2_nano.fcmae_ft_in22k_in1k_384", "torch")],
)  # fmt: skip
async def test_a_timm_classifier_answers_what_timm_answers(
    name: str, backend: str, folder: Path
) -> None:
    model, bodies = await served_photos(settings_for(name, folder, backend=backend, top_k=5))
    assert model["backend"]["name"] == backend
    assert model["task"] == "classify"
    expected = timm_models.classified(name, timm_models.checkpoint(name, folder), photos())
    tops = []
    for body, probabilities in zip(bodies, expected, strict=True):
        found = body["predictions"]
        order = np.argsort(-probabilities)[:5]
        assert [each["index"] for each in found][:1] == [int(order[0])]
        for each in found:
            assert each["score"] == pytest.approx(float(probabilities[each["index"]]),
                                                  abs=PROBABILITY[backend])  # fmt: skip
        tops.append(int(order[0]))
        # timm's own ImageNet names for its ImageNet classes.
        assert found[0]["label"] not in ("", str(found[0]["index"]))
    assert len(set(tops)) > 1, "the photos answer differently"
    # Some answers far from uniform (1e-3 for 1000 classes).
    assert max(float(p.max()) for p in expected) > 0.05, "some answers are confident"


@pytest.mark.parametrize("backend", ["torch", "openvino"])
async def test_a_timm_encoder_answers_its_pre_logits_features(backend: str, folder: Path) -> None:
    name = "test_convnext.r160_in1k"
    _, bodies = await served_photos(settings_for(name, folder, backend=backend, task="embed",
                                          embed_normalize=False))  # fmt: skip
    expected = timm_models.embedded(name, timm_models.checkpoint(name, folder), photos())
    for body, vector in zip(bodies, expected, strict=True):
        found = np.array(body["embedding"], dtype=np.float64)
        assert body["dim"] == len(vector)
        cosine = found @ vector / (np.linalg.norm(found) * np.linalg.norm(vector))
        assert cosine >= COSINE[backend]
        np.testing.assert_allclose(np.linalg.norm(found), np.linalg.norm(vector), rtol=1e-2)


def test_the_transform_is_timms_own(folder: Path) -> None:
    """Read from the model's pretrained_cfg: its size, interpolation, crop and mean."""
    bicubic = load_model("timm:test_convnext.r160_in1k", weights="none").transform
    assert (bicubic.crop_size, bicubic.resize_size, bicubic.interpolation) == (160, 168, "bicubic")
    assert bicubic.mean == (0.5, 0.5, 0.5)
    assert load_model("timm:test_resnet.r160_in1k", weights="none").transform.interpolation == (
        "bilinear"
    )
    squashed = load_model("timm:convnextv2_nano.fcmae_ft_in22k_in1k_384", weights="none")
    assert (squashed.transform.fit, squashed.transform.crop_size) == ("stretch", 384)
    larger = load_model("timm:test_convnext", weights="none", image_size=192).transform
    assert (larger.crop_size, larger.resize_size) == (192, 202)  # floor(192 / 0.95)


def test_what_cannot_be_served_stops_the_start(folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="timm has no model 'convnxt_tiny'; did you mean"):
        load_model("timm:convnxt_tiny", weights="none")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        load_model("timm:test_convnext.r160_in1k", weights="pretrained")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("timm:test_convnext", weights=str(folder / "missing.pth"))
    other = timm_models.checkpoint("test_resnet.r160_in1k", folder)
    with pytest.raises(ModelLoadError, match="does not fit timm's test_convnext"):
        load_model("timm:test_convnext", weights=str(other))
    # timm's preparations not served (a few of timm's largest models): one line, from the
    # model's own data config.
    config = {"input_size": (3, 224, 224), "interpolation": "bicubic", "crop_pct": 1.0,
              "mean": (0.5,) * 3, "std": (0.5,) * 3}  # fmt: skip
    with pytest.raises(TimmModelError, match="crop_mode='border'"):
        timm_transform(config | {"crop_mode": "border"}, None, "a_vit")
    with pytest.raises(TimmModelError, match=r"crop_mode='squash' with crop_pct=0\.95"):
        timm_transform(config | {"crop_mode": "squash", "crop_pct": 0.95}, None, "a_vit")
    with pytest.raises(TimmModelError, match="'lanczos' interpolation"):
        timm_transform(config | {"interpolation": "lanczos"}, None, "a_vit")
    with pytest.raises(ModelLoadError, match="TASK=classify or embed, not detect"):
        load_model("timm:test_convnext", weights="none", task="detect")

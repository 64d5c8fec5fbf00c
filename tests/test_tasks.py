"""Detection, segmentation and embeddings through the real app, with models whose right
answers are known from the pixels (``tests.models``): a white rectangle drawn on black is
found where it was drawn, in the original image's pixels, whatever the image's size and
aspect ratio and whichever images share its batch."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from app.engine import ModelLoadError, build_engine, load_model
from app.engine.checks.boxes import compare_detections
from app.engine.checks.startup_check import CHECK_RECORD
from app.engine.errors import CheckFailedError
from app.engine.model.export import ONNX_FILE, export_onnx
from app.engine.tasks.answers import Detected
from app.engine.tasks.outputs import detections, segmentation
from tests.checks import metric
from tests.conftest import make_settings, serve
from tests.models import bright_segmenter, mean_color_encoder

DETECTOR = "tests.models:bright_box_detector"
SIZE = 64  # the models' input side: small, so that letterboxing moves boxes a lot

# (width, height) and the white rectangle (x1, y1, x2, y2: x2, y2 exclusive) of each picture:
# landscape, portrait and square, none of them the input's size.
SHAPES = [((200, 100), (50, 20, 150, 60)), ((64, 128), (10, 64, 30, 120)),
          ((300, 300), (0, 150, 300, 300))]  # fmt: skip


def picture(size: tuple[int, int], box: tuple[int, int, int, int] | None) -> bytes:
    image = Image.new("RGB", size)
    if box is not None:
        ImageDraw.Draw(image).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill="white")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def tolerance(size: tuple[int, int]) -> float:
    """One input pixel, in the image's pixels, and one more for the resize's blur."""
    return 2 * max(size) / SIZE


def v2_body(*pictures: bytes, **parameters: Any) -> bytes:
    return orjson.dumps({
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(pictures)],
                    "data": [base64.b64encode(p).decode() for p in pictures]}],
        **({"parameters": parameters} if parameters else {}),
    })  # fmt: skip


def outputs_of(response: httpx.Response) -> dict[str, dict[str, Any]]:
    assert response.status_code == 200, response.text
    return {each["name"]: each for each in response.json()["outputs"]}


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "openvino"])
async def test_boxes_of_images_of_different_sizes_batched_together(
    tmp_path: Path, backend: str
) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("background\nbox\nimage\n")
    settings = make_settings(model=DETECTOR, task="detect", image_size=SIZE, labels=labels,
                             dispatch_when_idle=False, max_queue_delay_ms=300, backend=backend,
                             artifacts_dir=tmp_path / "artifacts")  # fmt: skip
    async with serve(settings) as (_, client):
        (served,) = (await client.get("/v1/models")).json()["models"]
        assert served["backend"]["name"] == backend
        if backend != "torch":  # exported whole, and checked against eager PyTorch in boxes
            assert served["check"]["passed"]
            assert served["check"]["box_recall"] == served["check"]["box_precision"] == 1.0
            assert served["check"]["reference_boxes"] > 0
        model = (await client.get("/v2/models/bright_box_detector")).json()
        assert [(o["name"], o["datatype"]) for o in model["outputs"]] == [
            ("boxes", "FP32"), ("scores", "FP32"), ("labels", "INT64"), ("num_detections", "INT32")
        ]  # fmt: skip
        before = metric((await client.get("/metrics")).text, "batchserve_batch_size_count")
        pictures = [picture(size, box) for size, box in SHAPES] + [picture((90, 40), None)]
        response = await client.post("/v2/models/bright_box_detector/infer",
                                     content=v2_body(*pictures))  # fmt: skip
        found = outputs_of(response)
        after = metric((await client.get("/metrics")).text, "batchserve_batch_size_count")
        assert after - before == 1  # the four images were one forward pass

        # The duplicate one pixel off is suppressed; the whole image (0.4) stays above 0.3.
        assert found["num_detections"]["data"] == [2, 2, 2, 0]
        assert found["boxes"]["shape"] == [4, 2, 4]
        assert found["labels"]["datatype"] == "INT64"
        boxes = np.array(found["boxes"]["data"]).reshape(4, 2, 4)
        scores = np.array(found["scores"]["data"]).reshape(4, 2)
        labels_out = np.array(found["labels"]["data"]).reshape(4, 2)
        for row, (size, box) in enumerate(SHAPES):
            np.testing.assert_allclose(boxes[row, 0], box, atol=tolerance(size))
            np.testing.assert_allclose(boxes[row, 1], [0, 0, *size], atol=tolerance(size))
            assert scores[row].tolist() == pytest.approx([0.9, 0.4])
            assert labels_out[row].tolist() == [1, 2]
        assert scores[3].tolist() == [0, 0]  # padding, as num_detections says

        answer = await client.post("/predict", content=pictures[0],
                                   headers={"content-type": "image/png"})  # fmt: skip
        assert answer.status_code == 200, answer.text
        detections = answer.json()["detections"]
        assert [(d["label"], d["index"]) for d in detections] == [("box", 1), ("image", 2)]
        np.testing.assert_allclose(detections[0]["box"], SHAPES[0][1],
                                   atol=tolerance(SHAPES[0][0]))  # fmt: skip
        assert detections[0]["score"] == pytest.approx(0.9)

        stricter = await client.post("/predict?min_score=0.5", content=pictures[0],
                                     headers={"content-type": "image/png"})  # fmt: skip
        assert [d["index"] for d in stricter.json()["detections"]] == [1]
        fewer = await client.post("/predict?max_detections=1", content=pictures[1],
                                  headers={"content-type": "image/png"})  # fmt: skip
        assert [d["index"] for d in fewer.json()["detections"]] == [1]
        none = await client.post("/predict", content=pictures[3],
                                 headers={"content-type": "image/png"})  # fmt: skip
        assert none.json()["detections"] == []

        asked = await client.post("/v2/models/bright_box_detector/infer",
                                  content=v2_body(pictures[0], min_score=0.5))  # fmt: skip
        assert outputs_of(asked)["num_detections"]["data"] == [1]
        bad = await client.post("/predict?min_score=2", content=pictures[0],
                                headers={"content-type": "image/png"})  # fmt: skip
        assert bad.status_code == 422
        for output, error in (({"name": "probabilities"}, "the outputs are boxes"),
                              ({"name": "boxes", "parameters": {"classification": 2}},
                               "for classifiers only")):  # fmt: skip
            refused = await client.post(
                "/v2/models/bright_box_detector/infer",
                content=(orjson.dumps({**orjson.loads(v2_body(pictures[0])), "outputs": [output]})),
            )
            assert refused.status_code == 422
            assert error in refused.json()["error"]


async def test_without_the_servers_suppression_every_box_is_answered() -> None:
    settings = make_settings(model=DETECTOR, task="detect", image_size=SIZE, nms_iou=0)
    async with serve(settings) as (_, client):
        response = await client.post("/predict", content=picture(*SHAPES[0]),
                                     headers={"content-type": "image/png"})  # fmt: skip
        assert [d["score"] for d in response.json()["detections"]] == pytest.approx([0.9, 0.8, 0.4])


async def test_a_jpeg_decoded_smaller_keeps_the_geometry_of_its_header() -> None:
    """A large JPEG is decoded scaled down in the DCT; its pixels are still resized to the
    content size its header gives (the size its boxes are mapped back from), not to one
    rounded from the smaller decoded picture, which can differ by a pixel of the input."""
    import math

    from preprocessing import Fit, TransformConfig, prepare
    from preprocessing.decode import dct_factor
    from preprocessing.formats import ImageFormat, ImageHeader
    from preprocessing.placement import letterbox_size

    transform = TransformConfig(crop_size=SIZE, resize_size=SIZE, fit=Fit.LETTERBOX)

    def rounds_apart(width: int, height: int) -> bool:
        header = ImageHeader(ImageFormat.JPEG, width, height)
        factor = dct_factor(header, min(letterbox_size(height, width, SIZE)))
        smaller = (math.ceil(height / factor), math.ceil(width / factor))
        return factor > 1 and letterbox_size(*smaller, SIZE) != letterbox_size(height, width, SIZE)

    width, height = next((w, h) for w in range(1200, 1400) for h in range(700, 900)
                         if rounds_apart(w, h))  # fmt: skip
    box = (width // 4, height // 3, width // 2, 2 * height // 3)
    image = Image.new("RGB", (width, height))
    ImageDraw.Draw(image).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill="white")
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=95)
    prepared = prepare(buffer.getvalue(), transform)
    assert prepared.pixels is not None
    assert tuple(prepared.pixels.shape[-2:]) == prepared.placement.content
    assert prepared.placement.content == letterbox_size(height, width, SIZE)
    settings = make_settings(model=DETECTOR, task="detect", image_size=SIZE)
    async with serve(settings) as (_, client):
        answer = await client.post("/predict", content=buffer.getvalue(),
                                   headers={"content-type": "image/jpeg"})  # fmt: skip
    found = answer.json()["detections"][0]["box"]
    np.testing.assert_allclose(found, box, atol=tolerance((width, height)))


async def test_no_box_without_area_nor_outside_the_image_is_answered() -> None:
    """A box that lies wholly in a letterbox's padding is clipped to nothing: no box, whatever
    its score, and every box answered lies inside its image."""
    settings = make_settings(model="tests.models:corner_box_detector", task="detect",
                             image_size=SIZE, min_score=0.5)  # fmt: skip
    size, box = SHAPES[0]  # 200 x 100: the bottom half of the input is padding
    async with serve(settings) as (_, client):
        answer = await client.post("/predict", content=picture(size, box),
                                   headers={"content-type": "image/png"})  # fmt: skip
        found = outputs_of(await client.post("/v2/models/corner_box_detector/infer",
                                             content=v2_body(picture(size, box))))  # fmt: skip
    detections = answer.json()["detections"]
    assert [d["index"] for d in detections] == [1]
    for detection in detections:
        x1, y1, x2, y2 = detection["box"]
        assert 0 <= x1 < x2 <= size[0]
        assert 0 <= y1 < y2 <= size[1]
    assert found["num_detections"]["data"] == [1]


async def test_a_detector_answering_torchvisions_list_of_dicts() -> None:
    settings = make_settings(model="tests.models:bright_list_detector", task="detect",
                             image_size=SIZE, dispatch_when_idle=False)  # fmt: skip
    async with serve(settings) as (_, client):
        pictures = [picture(*SHAPES[0]), picture((50, 50), None)]
        found = outputs_of(await client.post("/v2/models/bright_list_detector/infer",
                                             content=v2_body(*pictures)))  # fmt: skip
        assert found["num_detections"]["data"] == [1, 0]
        np.testing.assert_allclose(found["boxes"]["data"][:4], SHAPES[0][1],
                                   atol=tolerance(SHAPES[0][0]))  # fmt: skip


def mask_of(png: bytes) -> np.ndarray[Any, Any]:
    return np.asarray(Image.open(io.BytesIO(png)))


def expected_mask(size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray[Any, Any]:
    mask = np.zeros((size[1], size[0]), dtype=np.uint8)
    mask[box[1] : box[3], box[0] : box[2]] = 1
    return mask


async def test_masks_in_each_images_own_pixels() -> None:
    settings = make_settings(model="tests.models:bright_segmenter", image_size=SIZE,
                             task="segment")  # fmt: skip
    async with serve(settings) as (_, client):
        model = (await client.get("/v2/models/bright_segmenter")).json()
        assert model["outputs"] == [{"name": "mask", "datatype": "UINT8", "shape": [-1, -1, -1]}]
        for size, box in SHAPES:
            data = picture(size, box)
            answer = await client.post("/predict", content=data,
                                       headers={"content-type": "image/png"})  # fmt: skip
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["size"] == [size[1], size[0]]
            mask = mask_of(base64.b64decode(body["mask"]))
            assert mask.shape == (size[1], size[0])
            wrong = np.count_nonzero(mask != expected_mask(size, box))
            # Only the rectangle's edge can differ: one input pixel's width around it.
            assert wrong <= 2 * (box[2] - box[0] + box[3] - box[1]) * tolerance(size)
            counts = {each["index"]: each["pixels"] for each in body["classes"]}
            assert counts[1] == np.count_nonzero(mask == 1)
            png = await client.post("/predict", content=data, headers={
                "content-type": "image/png", "accept": "image/png"})  # fmt: skip
            assert png.headers["content-type"] == "image/png"
            assert np.array_equal(mask_of(png.content), mask)

        same = [picture(SHAPES[0][0], SHAPES[0][1]), picture(SHAPES[0][0], None)]
        found = outputs_of(await client.post("/v2/models/bright_segmenter/infer",
                                             content=v2_body(*same)))  # fmt: skip
        assert found["mask"]["shape"] == [2, 100, 200]
        masks = np.array(found["mask"]["data"]).reshape(2, 100, 200)
        assert masks[1].max() == 0
        assert masks[0].max() == 1
        mixed = await client.post(
            "/v2/models/bright_segmenter/infer",
            content=v2_body(picture(*SHAPES[0]), picture(*SHAPES[1])),
        )
        assert mixed.status_code == 400
        assert "send one image per request" in mixed.json()["error"]


async def test_a_segmenter_of_more_classes_than_a_byte_holds_answers_16_bit_masks() -> None:
    settings = make_settings(model="tests.models:many_class_segmenter", image_size=SIZE,
                             task="segment")  # fmt: skip
    size, box = SHAPES[0]
    async with serve(settings) as (_, client):
        model = (await client.get("/v2/models/many_class_segmenter")).json()
        assert model["outputs"] == [{"name": "mask", "datatype": "UINT16",
                                     "shape": [-1, -1, -1]}]  # fmt: skip
        answer = await client.post("/predict", content=picture(size, box),
                                   headers={"content-type": "image/png"})  # fmt: skip
        assert answer.status_code == 200, answer.text
        png = Image.open(io.BytesIO(base64.b64decode(answer.json()["mask"])))
        assert png.mode in ("I;16", "I")
        mask = np.asarray(png)
        assert set(np.unique(mask).tolist()) == {0, 299}
        wrong = np.count_nonzero((mask == 299) != expected_mask(size, box).astype(bool))
        assert wrong <= 2 * (box[2] - box[0] + box[3] - box[1]) * tolerance(size)
        found = outputs_of(await client.post("/v2/models/many_class_segmenter/infer",
                                             content=v2_body(picture(size, box))))  # fmt: skip
        assert found["mask"]["datatype"] == "UINT16"
        assert max(found["mask"]["data"]) == 299


def solid(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


@pytest.mark.parametrize("normalize", [True, False])
async def test_embeddings_are_the_features_the_pixels_give(normalize: bool) -> None:
    settings = make_settings(model="tests.models:mean_color_encoder", task="embed",
                             image_size=SIZE, embed_normalize=normalize)  # fmt: skip
    colors = [(200, 30, 90), (10, 250, 120)]
    expected = [np.tile((np.array(c) / 255 - MEAN) / STD, 4) for c in colors]
    if normalize:
        expected = [e / np.linalg.norm(e) for e in expected]
    async with serve(settings) as (_, client):
        for color, want in zip(colors, expected, strict=True):
            answer = (await client.post("/predict", content=solid(color, (120, 80)),
                                        headers={"content-type": "image/png"})).json()  # fmt: skip
            assert answer["dim"] == 12
            assert answer["normalized"] is normalize
            np.testing.assert_allclose(answer["embedding"], want, atol=1e-4)
        found = outputs_of(
            await client.post(
                "/v2/models/mean_color_encoder/infer",
                content=v2_body(solid(colors[0], (30, 90)), solid(colors[1], (300, 40))),
            )
        )
        assert found["embedding"]["shape"] == [2, 12]
        np.testing.assert_allclose(np.array(found["embedding"]["data"]).reshape(2, 12),
                                   np.stack(expected), atol=1e-4)  # fmt: skip
        models = (await client.get("/v1/models")).json()["models"]
        assert models[0]["task"] == "embed"
        assert models[0]["letterbox"] is False
        text = (await client.get("/metrics")).text
        assert metric(text, 'batchserve_model_info{task="embed"}') == 1


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
async def test_segmenters_and_encoders_served_by_a_runtime(tmp_path: Path, backend: str) -> None:
    """Exported like a classifier, and checked at start-up in the task's own terms: the share
    of pixels with eager PyTorch's class, the cosine of the vectors."""
    size, box = SHAPES[0]
    settings = make_settings(model="tests.models:bright_segmenter", image_size=SIZE,
                             task="segment", backend=backend, artifacts_dir=tmp_path)  # fmt: skip
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        answer = await client.post("/predict", content=picture(size, box),
                                   headers={"content-type": "image/png"})  # fmt: skip
    assert model["backend"]["name"] == backend
    assert model["backend"]["artifact"].startswith(str(tmp_path))
    assert model["check"]["passed"] is True
    assert model["check"]["min_pixel_agreement"] == 1.0
    mask = mask_of(base64.b64decode(answer.json()["mask"]))
    wrong = np.count_nonzero(mask != expected_mask(size, box))
    assert wrong <= 2 * (box[2] - box[0] + box[3] - box[1]) * tolerance(size)

    settings = make_settings(model="tests.models:mean_color_encoder", image_size=SIZE,
                             task="embed", backend=backend, artifacts_dir=tmp_path)  # fmt: skip
    color = (200, 30, 90)
    want = np.tile((np.array(color) / 255 - MEAN) / STD, 4)
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        answer = await client.post("/predict", content=solid(color, (120, 80)),
                                   headers={"content-type": "image/png"})  # fmt: skip
    assert model["backend"]["name"] == backend
    assert model["check"]["min_cosine"] > 0.9999
    np.testing.assert_allclose(answer.json()["embedding"], want / np.linalg.norm(want), atol=1e-4)


class Swapped(nn.Module):
    """The bright segmenter with its two classes swapped: what a broken export would compute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -segmentation(bright_segmenter()(x))


class Negated(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -mean_color_encoder()(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("task", "model", "broken", "figure"), [
    ("segment", "tests.models:bright_segmenter", Swapped(), "pixel_agreement"),
    ("embed", "tests.models:mean_color_encoder", Negated(), "cosine"),
])  # fmt: skip
def test_an_export_that_answers_otherwise_stops_start_up(
    tmp_path: Path, task: str, model: str, broken: nn.Module, figure: str
) -> None:
    settings = make_settings(model=model, image_size=SIZE, task=task, backend="onnxruntime",
                             artifacts_dir=tmp_path)  # fmt: skip
    build_engine(settings.own_model())
    (folder,) = [path for path in tmp_path.iterdir() if (path / ONNX_FILE).is_file()]
    (folder / CHECK_RECORD).unlink()  # the verdict kept for the good export
    export_onnx(broken, (3, SIZE, SIZE), folder / ONNX_FILE)
    with pytest.raises(CheckFailedError, match=f"disagrees with eager PyTorch.*{figure}"):
        build_engine(settings.own_model())


def test_a_torchvision_classifier_becomes_an_encoder_of_its_penultimate_features() -> None:
    loaded = load_model("resnet18", "none", image_size=32, task="embed")
    assert loaded.task == "embed"
    assert loaded.dimensions == 512
    assert loaded.labels == ()


def test_a_model_whose_outputs_do_not_fit_its_task_stops_with_one_line() -> None:
    with pytest.raises(ModelLoadError) as raised:
        load_model("tests.models:color_classifier", "none", image_size=SIZE, task="detect")
    message = str(raised.value)
    assert "\n" not in message
    assert "TASK=detect and must return (boxes [batch, K, 4]" in message
    assert "a tensor of shape [2, 12]" in message
    with pytest.raises(ModelLoadError, match=r"TASK=segment .*\[batch, classes, height"):
        load_model("tests.models:color_classifier", "none", image_size=SIZE, task="segment")


def test_torchvisions_architectures_name_their_task() -> None:
    from app.engine.tasks import resolve_task

    assert resolve_task("auto", "fasterrcnn_mobilenet_v3_large_320_fpn") == "detect"
    assert resolve_task("auto", "ssdlite320_mobilenet_v3_large") == "detect"
    assert resolve_task("auto", "deeplabv3_mobilenet_v3_large") == "segment"
    assert resolve_task("auto", "lraspp_mobilenet_v3_large") == "segment"
    assert resolve_task("auto", "resnet50") == "classify"
    assert resolve_task("auto", "tests.models:bright_box_detector") == "classify"
    assert resolve_task("embed", "resnet50") == "embed"


@pytest.mark.parametrize("name", ["ssdlite320_mobilenet_v3_large",
                                  "fasterrcnn_mobilenet_v3_large_320_fpn"])  # fmt: skip
def test_a_torchvision_detector_answers_the_servers_batch_as_it_answers_its_own_call(
    name: str,
) -> None:
    """Given the server's batch of photos (each resized and normalised as the model's own
    transform does it, padded to the batch's canvas, told its own size), the served detector
    answers the boxes, scores and labels, best first, that ``model([image])`` answers for each
    photo, mapped to the same pixels: with weights whose scores spread, not torchvision's
    initialisation, whose scores all tie (equal scores may come out in either order)."""
    import torch
    from torchvision.models import get_model

    from app.engine.tasks.adapters import TorchvisionDetector
    from harness.reference import decoded
    from harness.spread import spread
    from preprocessing import normalize_into, prepare
    from tests import fidelity

    reference: Any = get_model(name, weights=None, weights_backbone=None).eval()
    photos = [fidelity.photos()[0], fidelity.photos()[1]]  # one shape, two photos
    floats = [decoded(photo).float() / 255 for photo in photos]
    spread(reference, lambda model: [model([each]) for each in floats], class_spread=2.0)
    loaded = load_model(name, "none")
    served = loaded.module.eval()
    assert isinstance(served, TorchvisionDetector)
    served.model.load_state_dict(reference.state_dict())
    prepared = [prepare(photo, loaded.transform) for photo in photos]
    (canvas,) = {each.canvas for each in prepared}
    batch = torch.empty(len(photos), 3, *canvas)
    pixels = [each.pixels for each in prepared if each.pixels is not None]
    normalize_into(pixels, batch, loaded.transform, [each.placement for each in prepared])
    with torch.inference_mode():
        got = served(batch, [each.placement.content for each in prepared])
        want = [reference([image])[0] for image in floats]
    for row, (each, answer) in enumerate(zip(prepared, want, strict=True)):
        where = each.placement
        found = int((got.scores[row] > 0).sum())
        assert found == len(answer["scores"]) > 10
        scale = torch.tensor([where.width / where.content_width,
                              where.height / where.content_height] * 2)  # fmt: skip
        ours = Detected(
            (got.boxes[row, :found] * scale).numpy(),
            got.scores[row, :found].numpy(),
            got.labels[row, :found].numpy(),
        )
        theirs = Detected(answer["boxes"].numpy(), answer["scores"].numpy(),
                          answer["labels"].numpy())  # fmt: skip
        # Every box, label and score found again. The input differs from torchvision's by
        # float rounding (it resizes the normalised image, the server the pixels; the batch's
        # kernels are not one image's), which random deep weights carry to the third decimal
        # of a score: which of two boxes scoring alike to that decimal makes the last place
        # is rounding, and only there is a box excused.
        figures = compare_detections([theirs], [ours], tie=5e-3)
        assert figures["box_recall"] == figures["box_precision"] == 1.0, figures
        assert figures["tied_boxes"] <= 2, figures
        assert figures["matched_iou"] > 0.999, figures
        assert figures["max_score_difference"] < 5e-3, figures
        torch.testing.assert_close(got.scores[row, :found], answer["scores"], rtol=0, atol=5e-3)


@pytest.mark.parametrize("per_image", [100_000, 20])
def test_ssds_detections_for_the_batch_are_torchvisions_image_by_image(per_image: int) -> None:
    """The batch at once (``tasks.ssd``) answers what ``SSD.postprocess_detections`` answers
    image by image and class by class: the same boxes, scores and labels in the same order,
    on head outputs whose scores are spread enough not to tie; with every detection kept, and
    with the best few of each image (found by suppressing the best candidates only)."""
    import torch
    from torchvision.models import get_model

    from app.engine.tasks.ssd import batched_detections

    model: Any = get_model("ssdlite320_mobilenet_v3_large", weights=None,
                           weights_backbone=None).eval()  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    # Every detection kept (the score threshold decides what is answered), or the best few.
    model.detections_per_img = per_image
    n, anchors, classes = 3, 400, 91
    regression = torch.randn(n, anchors, 4, generator=generator)
    logits = 4 * torch.randn(n, anchors, classes, generator=generator)
    corners = torch.rand(n, anchors, 2, generator=generator) * 280
    sides = 10 + 30 * torch.rand(n, anchors, 2, generator=generator)
    priors = torch.cat([corners, corners + sides], dim=2)
    want = model.postprocess_detections(
        {"bbox_regression": regression, "cls_logits": logits}, list(priors), [(320, 320)] * n
    )
    boxes, scores, labels, *_ = batched_detections(
        regression, logits, priors, model.box_coder, (320, 320),
        score_thresh=model.score_thresh, topk=model.topk_candidates,
        nms_thresh=model.nms_thresh, per_image=model.detections_per_img,
    )  # fmt: skip
    want_boxes, want_scores, want_labels, *_ = detections(want)
    assert int((want_scores > 0).sum()) > min(300, 3 * per_image - 1)
    torch.testing.assert_close(scores, want_scores)  # best first, ties and all
    for image in range(n):  # the same detections; equal scores in either order
        torch.testing.assert_close(
            ranked(boxes[image], scores[image], labels[image]),
            ranked(want_boxes[image], want_scores[image], want_labels[image]),
        )


def ranked(boxes: Any, scores: Any, labels: Any) -> Any:
    """One image's detections as rows ``(score, label, x1, y1, x2, y2)`` in one order."""
    import torch

    rows = torch.cat([scores[:, None], labels[:, None].float(), boxes], dim=1)
    for column in reversed(range(rows.shape[1])):  # lexicographic: stable sorts, last key first
        rows = rows[torch.sort(rows[:, column], stable=True).indices]
    return rows


@pytest.mark.e2e
def test_every_task_over_grpc_from_one_repository(tmp_path: Path) -> None:
    """A repository whose ``config.toml`` files name each task, in one real uvicorn process,
    asked with Triton's own gRPC client: the same outputs as over REST."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from harness.servers import UvicornProcess
    from tests.repository import add_model

    common: dict[str, Any] = {"image_size": SIZE, "compile": "none"}
    add_model(tmp_path, "boxes", model=DETECTOR, task="detect", **common)
    add_model(tmp_path, "masks", model="tests.models:bright_segmenter", task="segment", **common)
    add_model(tmp_path, "vectors", model="tests.models:mean_color_encoder", task="embed",
              **common)  # fmt: skip
    env = {"BATCHSERVE_MODEL_REPOSITORY": str(tmp_path), "BATCHSERVE_LOG_LEVEL": "warning"}
    pictures = [picture(*SHAPES[0]), picture(*SHAPES[1])]
    with UvicornProcess(env) as server:
        client = grpcclient.InferenceServerClient(server.grpc_target)
        try:

            def infer(model: str, batch: list[bytes]) -> Any:
                tensor = grpcclient.InferInput("image", [len(batch)], "BYTES")
                tensor.set_data_from_numpy(np.array(batch, dtype=np.object_))
                return client.infer(model, [tensor])

            def rest(model: str, batch: list[bytes]) -> dict[str, dict[str, Any]]:
                return outputs_of(httpx.post(f"{server.url}/v2/models/{model}/infer",
                                             content=v2_body(*batch)))  # fmt: skip

            metadata = client.get_model_metadata("boxes", as_json=True)
            assert [o["name"] for o in metadata["outputs"]] == [
                "boxes", "scores", "labels", "num_detections"]  # fmt: skip
            found = infer("boxes", pictures)
            over_rest = rest("boxes", pictures)
            assert found.as_numpy("num_detections").tolist() == [2, 2]
            assert found.as_numpy("labels").dtype == np.int64
            np.testing.assert_allclose(found.as_numpy("boxes").ravel(),
                                       over_rest["boxes"]["data"], atol=1e-4)  # fmt: skip
            for row, (size, box) in enumerate(SHAPES[:2]):
                np.testing.assert_allclose(found.as_numpy("boxes")[row, 0], box,
                                           atol=tolerance(size))  # fmt: skip

            mask = infer("masks", pictures[:1]).as_numpy("mask")
            assert mask.dtype == np.uint8
            assert mask.shape == (1, 100, 200)
            assert np.array_equal(mask.ravel(), rest("masks", pictures[:1])["mask"]["data"])

            vectors = infer("vectors", pictures).as_numpy("embedding")
            assert vectors.shape == (2, 12)
            np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
            np.testing.assert_allclose(vectors.ravel(), rest("vectors", pictures)["embedding"][
                "data"], atol=1e-5)  # fmt: skip
        finally:
            client.close()


def test_the_best_survivors_are_found_however_many_better_boxes_are_suppressed() -> None:
    """Five clusters of fifty near-equal boxes: the best candidates all suppress one another,
    so the search for four survivors must widen until it has looked at every cluster."""
    import torch
    from torchvision.ops import batched_nms

    from app.engine.tasks.ssd import best_survivors

    generator = torch.Generator().manual_seed(0)
    corners = (torch.arange(5).repeat_interleave(50) * 100.0)[:, None].repeat(1, 2)
    boxes = torch.cat([corners, corners + 50], dim=1) + torch.rand(250, 4, generator=generator)
    scores = torch.rand(250, generator=generator) * (1 - torch.arange(250) / 500)
    labels = torch.ones(250, dtype=torch.int64)
    found = best_survivors(boxes, scores, labels, 0.5, keep=4)
    assert found.tolist() == batched_nms(boxes, scores, labels, 0.5)[:4].tolist()
    assert len(found) == 4

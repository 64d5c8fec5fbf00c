"""What a peer does for each task, written as a user of that server would, following
torchvision's documentation: the model with random weights and its own preprocessing, answers
in the original image's pixels.

- classify: ``classifier`` (resize, centre crop, top-5);
- detect: ``model(list_of_images)`` as torchvision documents it: each image a float tensor, the
  model's own transform resizing it (its ``min_size`` and ``max_size``, or SSD's fixed size)
  and padding the list to a common size, boxes mapped back to the image's pixels by the model;
  those above 0.3 answered, at most 100;
- segment: the weights' own ``transforms()`` (the shorter side resized to 520, normalised); a
  batch needs one shape, so the images of each shape are stacked and run together; the
  per-pixel arg-max resized back to the image's size and answered as a PNG, with each class's
  pixel count;
- an Ultralytics YOLO checkpoint (``PEER_MODEL=*.pt``), as Ultralytics' own LitServe guide
  shows: ``YOLO(path)`` once, then ``model.predict(list_of_images)`` on the batch's PIL images
  (Ultralytics letterboxes and batches them itself), boxes above 0.3, at most 100;
- a Hugging Face transformers model (``PEER_MODEL=hf:<directory>``), as transformers documents
  it: ``AutoImageProcessor`` on the batch's PIL images, the model, and (a detector) the
  processor's ``post_process_object_detection(outputs, threshold, target_sizes)``.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch
import torchvision
from PIL import Image
from torch.nn.functional import interpolate
from torchvision import transforms

from benchmarks.peer_apps import classifier

MODEL = classifier.MODEL
DETECTORS = ("fasterrcnn_", "retinanet_", "fcos_", "ssd", "maskrcnn_")
SEGMENTERS = ("deeplabv3_", "fcn_", "lraspp_")


def _hf_task() -> str:
    import json
    from pathlib import Path

    config = json.loads((Path(MODEL.removeprefix("hf:")) / "config.json").read_text())
    detector = config["architectures"][0].endswith("ForObjectDetection")
    return "hf-detect" if detector else "hf-classify"


TASK = (_hf_task() if MODEL.startswith("hf:") else "yolo" if MODEL.endswith(".pt")
        else "detect" if MODEL.startswith(DETECTORS)
        else "segment" if MODEL.startswith(SEGMENTERS) else "classify")  # fmt: skip
MIN_SCORE = 0.3
MAX_DETECTIONS = 100

TO_TENSOR = transforms.ToTensor()


def segment_transform() -> Any:
    """The weights' own preprocessing (a description: making it downloads nothing)."""
    return torchvision.models.get_model_weights(MODEL).DEFAULT.transforms()


SEGMENT_TRANSFORM: Any = segment_transform() if TASK == "segment" else None


def build() -> Any:
    if TASK in ("classify", "hf-classify"):
        return classifier.build()
    if TASK == "hf-detect":
        from transformers import AutoModelForObjectDetection

        return AutoModelForObjectDetection.from_pretrained(MODEL.removeprefix("hf:")).eval()
    if TASK == "yolo":
        from ultralytics import YOLO

        return YOLO(MODEL)
    model: Any = torchvision.models.get_model(MODEL, weights=None, weights_backbone=None)
    return model.eval()


def decode(data: bytes) -> tuple[Any, tuple[int, int]]:
    """The model's input for one image, and the image's (height, width)."""
    if TASK in ("classify", "hf-classify"):
        return classifier.to_tensor(data), (0, 0)
    if TASK in ("yolo", "hf-detect"):
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
            return rgb, (rgb.height, rgb.width)
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        size = (rgb.height, rgb.width)
        transform = TO_TENSOR if TASK == "detect" else SEGMENT_TRANSFORM
        tensor: torch.Tensor = transform(rgb)
        return tensor, size


def predict(model: Any, inputs: list[tuple[Any, tuple[int, int]]],
            device: str) -> list[dict[str, Any]]:  # fmt: skip
    """Each image's answer."""
    if TASK == "yolo":
        # An instance segmenter's masks in each image's own pixels, as batchserve answers them.
        found = model.predict([image for image, _ in inputs], verbose=False, device=device,
                              conf=MIN_SCORE, max_det=MAX_DETECTIONS,
                              retina_masks=True)  # fmt: skip
        return [yolo_detections(result) for result in found]
    if TASK.startswith("hf-"):
        return hf_predict(model, inputs, device)
    tensors = [tensor.to(device) for tensor, _ in inputs]
    if TASK == "classify":
        return classifier.classify(model, torch.stack(tensors))
    with torch.inference_mode():
        if TASK == "detect":
            return [detections(found) for found in model(tensors)]
        shapes: dict[tuple[int, ...], list[int]] = {}
        for index, tensor in enumerate(tensors):
            shapes.setdefault(tuple(tensor.shape), []).append(index)
        answers: dict[int, dict[str, Any]] = {}
        for indices in shapes.values():
            logits = model(torch.stack([tensors[i] for i in indices]))["out"]
            classes = logits.argmax(dim=1).to(torch.uint8)
            for index, row in zip(indices, classes, strict=True):
                answers[index] = mask(row, inputs[index][1])
    return [answers[index] for index in range(len(tensors))]


def hf_predict(model: Any, inputs: list[tuple[Any, tuple[int, int]]],
               device: str) -> list[dict[str, Any]]:  # fmt: skip
    """The processor on the batch's images, the model, and its post-processing."""
    processor = classifier.TRANSFORM if TASK == "hf-classify" else HF_PROCESSOR
    batch = processor(images=[image for image, _ in inputs], return_tensors="pt").to(device)
    if TASK == "hf-classify":
        return classifier.classify(model, batch["pixel_values"])
    with torch.inference_mode():
        outputs = model(**batch)
    found = HF_PROCESSOR.post_process_object_detection(
        outputs, threshold=MIN_SCORE, target_sizes=[size for _, size in inputs]
    )
    return [detections(each) for each in found]


def _hf_processor() -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(MODEL.removeprefix("hf:"))


HF_PROCESSOR: Any = _hf_processor() if TASK == "hf-detect" else None


def detections(found: dict[str, torch.Tensor]) -> dict[str, Any]:
    keep = found["scores"] >= MIN_SCORE
    boxes, scores, labels = (found[key][keep][:MAX_DETECTIONS].tolist()
                             for key in ("boxes", "scores", "labels"))  # fmt: skip
    found_here = zip(boxes, scores, labels, strict=True)
    return {"detections": [{"index": label, "score": score, "box": box}
                           for box, score, label in found_here]}  # fmt: skip


def mask(classes: torch.Tensor, size: tuple[int, int]) -> dict[str, Any]:
    resized = interpolate(classes[None, None], size=size, mode="nearest")[0, 0].numpy()
    indices, counts = np.unique(resized, return_counts=True)
    buffer = io.BytesIO()
    Image.fromarray(resized, mode="L").save(buffer, "PNG", compress_level=1)
    classes_found = [{"index": int(i), "pixels": int(c)}
                     for i, c in zip(indices, counts, strict=True)]  # fmt: skip
    return {"size": list(size), "mask": base64.b64encode(buffer.getvalue()).decode(),
            "classes": classes_found}  # fmt: skip


def yolo_detections(result: Any) -> dict[str, Any]:
    boxes = result.boxes
    found = [
        {"index": int(label), "score": float(score), "box": [float(v) for v in box]}
        for box, score, label in zip(boxes.xyxy.tolist(), boxes.conf.tolist(),
                                     boxes.cls.tolist(), strict=True)
    ]  # fmt: skip
    if result.masks is not None:  # COCO run-length, as batchserve encodes them
        from pycocotools import mask as coco

        binary = result.masks.data.cpu().numpy().astype(np.uint8).transpose(1, 2, 0)
        for each, encoded in zip(found, coco.encode(np.asfortranarray(binary)), strict=True):
            each["mask"] = {"size": encoded["size"], "counts": encoded["counts"].decode()}
    return {"detections": found}

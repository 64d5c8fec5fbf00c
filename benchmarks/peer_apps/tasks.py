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
  (Ultralytics letterboxes and batches them itself), boxes above 0.3, at most 100.
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
TASK = ("yolo" if MODEL.endswith(".pt") else "detect" if MODEL.startswith(DETECTORS)
        else "segment" if MODEL.startswith(SEGMENTERS) else "classify")  # fmt: skip
MIN_SCORE = 0.3
MAX_DETECTIONS = 100

TO_TENSOR = transforms.ToTensor()


def segment_transform() -> Any:
    """The weights' own preprocessing (a description: making it downloads nothing)."""
    return torchvision.models.get_model_weights(MODEL).DEFAULT.transforms()


SEGMENT_TRANSFORM: Any = segment_transform() if TASK == "segment" else None


def build() -> Any:
    if TASK == "classify":
        return classifier.build()
    if TASK == "yolo":
        from ultralytics import YOLO

        return YOLO(MODEL)
    model: Any = torchvision.models.get_model(MODEL, weights=None, weights_backbone=None)
    return model.eval()


def decode(data: bytes) -> tuple[Any, tuple[int, int]]:
    """The model's input for one image, and the image's (height, width)."""
    if TASK == "classify":
        return classifier.to_tensor(data), (0, 0)
    if TASK == "yolo":
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

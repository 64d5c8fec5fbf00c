"""What a peer does for each task, written as a user of that server would: torchvision's
model with random weights, torchvision's transforms, answers in the original image's pixels.

- classify: ``classifier`` (resize, centre crop, top-5);
- detect: the detector's own transform (images of any size in one list; resized so that their
  longer side is the served size, as batchserve letterboxes to it), boxes above 0.3, at most
  100, in the original image's pixels (torchvision maps them back itself);
- segment: each image resized to the served square (the aspect ratio lost: a batch needs one
  shape), the per-pixel arg-max resized back to the image's size and answered as a PNG, with
  each class's pixel count.
"""

from __future__ import annotations

import base64
import io
import os
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
TASK = ("detect" if MODEL.startswith(DETECTORS)
        else "segment" if MODEL.startswith(SEGMENTERS) else "classify")  # fmt: skip
SIZE = int(os.environ.get("PEER_IMAGE_SIZE", "320" if TASK == "detect" else "520"))
MIN_SCORE = 0.3
MAX_DETECTIONS = 100

TO_TENSOR = transforms.ToTensor()
SEGMENT_TRANSFORM = transforms.Compose([
    transforms.Resize((SIZE, SIZE)),
    transforms.ToTensor(),
    transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
])  # fmt: skip


def build() -> torch.nn.Module:
    if TASK == "classify":
        return classifier.build()
    model: Any = torchvision.models.get_model(MODEL, weights=None, weights_backbone=None)
    if TASK == "detect":
        model.transform.min_size = (SIZE,)
        model.transform.max_size = SIZE
    return model.eval()  # type: ignore[no-any-return]


def decode(data: bytes) -> tuple[torch.Tensor, tuple[int, int]]:
    """The model's input for one image, and the image's (height, width)."""
    if TASK == "classify":
        return classifier.to_tensor(data), (0, 0)
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        size = (rgb.height, rgb.width)
        tensor: torch.Tensor = (TO_TENSOR if TASK == "detect" else SEGMENT_TRANSFORM)(rgb)
        return tensor, size


def predict(model: torch.nn.Module, inputs: list[tuple[torch.Tensor, tuple[int, int]]],
            device: str) -> list[dict[str, Any]]:  # fmt: skip
    """Each image's answer."""
    tensors = [tensor.to(device) for tensor, _ in inputs]
    if TASK == "classify":
        return classifier.classify(model, torch.stack(tensors))
    with torch.inference_mode():
        if TASK == "detect":
            return [detections(found) for found in model(tensors)]
        logits = model(torch.stack(tensors))["out"]
        classes = logits.argmax(dim=1).to(torch.uint8)
    return [mask(row, size) for row, (_, size) in zip(classes, inputs, strict=True)]


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

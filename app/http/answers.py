"""``/predict``'s answer for each task, in JSON (or, for a segmenter asked for
``image/png``, the mask itself).

- classify: ``{"model", "version", "predictions": [{"index", "label", "score"}]}``;
- detect: ``{"model", "version", "detections": [{"index", "label", "score", "box": [x1, y1,
  x2, y2]}]}``, boxes in the original image's pixels, best first; an instance segmenter's
  each with its ``"mask": {"size": [h, w], "counts": "..."}`` (COCO run-length, in the
  image's pixels), a keypoint detector's with its ``"keypoints": [[x, y, score], ...]``;
- segment: ``{"model", "version", "size": [h, w], "classes": [{"index", "label",
  "pixels"}], "mask": <PNG, base64>}``: the mask a PNG of the image's size whose pixel values
  are class indices (8-bit grey, 16-bit past 256 classes);
- embed: ``{"model", "version", "embedding": [...], "dim", "normalized"}``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from PIL import Image

from app.serving.inference import InferenceResponse, Prediction

PNG = "image/png"


def wants_png(accept: str | None) -> bool:
    """Whether ``Accept`` asks for the mask as a PNG rather than JSON."""
    return bool(accept) and PNG in (accept or "").lower()


def body(answer: InferenceResponse, prediction: Prediction, png: bool) -> tuple[bytes, str]:
    """The answer's bytes and media type (``png``: a segmenter's mask alone)."""
    head: dict[str, Any] = {"model": answer.model, "version": answer.version}
    task = answer.task
    if task == "detect":
        head["detections"] = detections(prediction, answer.labels)
    elif task == "segment":
        assert prediction.mask is not None
        encoded = mask_png(prediction.mask)
        if png:
            return encoded, PNG
        head |= segmentation(prediction.mask, answer.labels, encoded)
    elif task == "embed":
        assert prediction.embedding is not None
        head |= {"embedding": prediction.embedding.tolist(), "dim": len(prediction.embedding),
                 "normalized": answer.normalized}  # fmt: skip
    else:
        head["predictions"] = prediction.classes
    return orjson.dumps(head), "application/json"


def label_of(labels: Sequence[str], index: int) -> str:
    return labels[index] if 0 <= index < len(labels) else str(index)


def detections(prediction: Prediction, labels: Sequence[str]) -> list[dict[str, Any]]:
    found = prediction.detected
    if found is None:
        return []
    entries = [
        {"index": int(index), "label": label_of(labels, int(index)), "score": float(score),
         "box": [float(value) for value in box]}
        for box, score, index in zip(found.boxes, found.scores, found.labels, strict=True)
    ]  # fmt: skip
    if found.masks is not None:
        for entry, mask in zip(entries, found.masks, strict=True):
            entry["mask"] = mask
    if found.keypoints is not None:
        for entry, points in zip(entries, found.keypoints.tolist(), strict=True):
            entry["keypoints"] = points
    return entries


def segmentation(
    mask: np.ndarray[Any, Any], labels: Sequence[str], encoded: bytes
) -> dict[str, Any]:
    indices, counts = np.unique(mask, return_counts=True)
    return {
        "size": [int(mask.shape[0]), int(mask.shape[1])],
        "classes": [{"index": int(index), "label": label_of(labels, int(index)),
                     "pixels": int(count)} for index, count in zip(indices, counts, strict=True)],
        "mask": base64.b64encode(encoded).decode(),
    }  # fmt: skip


def mask_png(mask: np.ndarray[Any, Any]) -> bytes:
    """A mask of class indices as a PNG of its size: 8-bit grey, 16-bit past 256 classes
    (Pillow writes no 32-bit PNG)."""
    # 8-bit grey (L) from uint8, 16-bit grey (I;16) from uint16: Pillow's own modes for them.
    image = Image.fromarray(mask if mask.dtype == np.uint8 else mask.astype(np.uint16))
    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()

"""A model's answers as its own library gives them: the reference a served model is held to.

torchvision, called as its documentation shows: the photo decoded by ``torchvision.io`` (its
EXIF orientation applied), then for a detector ``model([image])`` on the float image (its
own transform resizes and normalises; boxes, masks and keypoints come back in the photo's
pixels, masks pasted, binarised at 0.5 as the documentation does), for a segmenter the
weights' ``SemanticSegmentation`` preset, ``model(batch)["out"]`` and its arg-max (mapped to
the photo's pixels by nearest neighbour, as the server maps its own), for a classifier the
weights' ``ImageClassification`` preset and a softmax. Ultralytics, as its documentation
shows: ``YOLO(file).predict(image)`` on the decoded photo, its results' boxes, classes,
scores and keypoints (``yolo_detected``), or its class probabilities (``yolo_classified``).
One image at a time, eager, fp32 on the CPU: nothing of the server runs here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from app.engine import Detected
from preprocessing import TransformConfig


def decoded(data: bytes) -> torch.Tensor:
    """``uint8[3, H, W]`` as ``torchvision.io.decode_image`` gives it, upright."""
    from torchvision.io import ImageReadMode, decode_image

    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    image: torch.Tensor = decode_image(encoded, mode=ImageReadMode.RGB,
                                       apply_exif_orientation=True)  # fmt: skip
    return image


def detected(model: nn.Module, photos: Sequence[bytes]) -> list[Detected]:
    """A torchvision detector's answers, photo by photo: ``model([image])``."""
    from pycocotools import mask as coco

    answers = []
    for data in photos:
        image = decoded(data).float() / 255
        with torch.inference_mode():
            (found,) = model.eval()([image])
        masks = None
        if "masks" in found:
            binary = (found["masks"][:, 0] > 0.5).permute(1, 2, 0).numpy().astype(np.uint8)
            masks = [{"size": [int(each["size"][0]), int(each["size"][1])],
                      "counts": each["counts"].decode("ascii")}
                     for each in coco.encode(np.asfortranarray(binary))]  # fmt: skip
        keypoints = None
        if "keypoints" in found:
            points, scores = found["keypoints"][..., :2], found["keypoints_scores"][..., None]
            keypoints = torch.cat([points, scores], dim=2).numpy()
        answers.append(Detected(found["boxes"].numpy(), found["scores"].numpy(),
                                found["labels"].numpy(), masks, keypoints))  # fmt: skip
    return answers


def segmented(
    model: nn.Module, photos: Sequence[bytes], transform: TransformConfig
) -> list[np.ndarray[Any, Any]]:
    """A torchvision segmenter's masks, photo by photo, through its weights' preset
    (``SemanticSegmentation`` at the transform's size and statistics)."""
    from torch.nn.functional import interpolate
    from torchvision.transforms._presets import SemanticSegmentation

    preset = SemanticSegmentation(resize_size=transform.resize_size, mean=transform.mean,
                                  std=transform.std)  # fmt: skip
    masks = []
    for data in photos:
        image = decoded(data)
        with torch.inference_mode():
            output = model.eval()(preset(image)[None])
        logits = output["out"] if isinstance(output, dict) else output
        classes = logits.argmax(dim=1, keepdim=True).float()
        mask = interpolate(classes, size=tuple(image.shape[-2:]), mode="nearest")[0, 0]
        masks.append(mask.to(torch.int64).numpy())
    return masks


def classified(model: nn.Module, photos: Sequence[bytes], weights: Any) -> torch.Tensor:
    """A torchvision classifier's class probabilities ``[photos, classes]`` through its
    weights' ``ImageClassification`` preset."""
    preset = weights.transforms()
    rows = []
    for data in photos:
        with torch.inference_mode():
            rows.append(torch.softmax(model.eval()(preset(decoded(data))[None]), dim=1)[0])
    return torch.stack(rows)


def yolo_detected(path: str, photos: Sequence[bytes], **predict: Any) -> list[Detected]:
    """An Ultralytics YOLO file's answers, photo by photo: ``YOLO(path).predict(image)``
    (an instance segmenter's masks as run-length, with ``retina_masks=True`` in ``predict``:
    in the image's own pixels)."""
    import io

    from PIL import Image
    from pycocotools import mask as coco
    from ultralytics import YOLO

    model = YOLO(path)
    answers = []
    for data in photos:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        with warnings.catch_warnings():  # torch.jit.load, deprecated, loads an export
            warnings.simplefilter("ignore", FutureWarning)
            (result,) = model.predict(image, verbose=False, **predict)
        boxes = result.boxes
        keypoints = None
        if result.keypoints is not None:
            points = result.keypoints.data  # [k, P, 3] (or [k, P, 2])
            if points.shape[-1] == 2:
                points = torch.cat([points, torch.ones_like(points[..., :1])], dim=-1)
            keypoints = points.cpu().numpy()
        masks = None
        if result.masks is not None:  # [k, h, w]: the image's own pixels with retina_masks
            binary = result.masks.data.cpu().numpy().astype(np.uint8).transpose(1, 2, 0)
            masks = [{"size": [int(each["size"][0]), int(each["size"][1])],
                      "counts": each["counts"].decode("ascii")}
                     for each in coco.encode(np.asfortranarray(binary))]  # fmt: skip
        answers.append(Detected(boxes.xyxy.cpu().numpy(), boxes.conf.cpu().numpy(),
                                boxes.cls.cpu().numpy().astype(np.int64), masks,
                                keypoints))  # fmt: skip
    return answers


def yolo_classified(path: str, photos: Sequence[bytes]) -> torch.Tensor:
    """An Ultralytics YOLO classifier's class probabilities ``[photos, classes]``."""
    import io

    from PIL import Image
    from ultralytics import YOLO

    model = YOLO(path)
    rows = []
    for data in photos:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        (result,) = model.predict(image, verbose=False)
        rows.append(result.probs.data.float().cpu())
    return torch.stack(rows)

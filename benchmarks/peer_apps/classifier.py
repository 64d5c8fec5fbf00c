"""The model and preprocessing every peer serves: a torchvision classifier with random weights
(as batchserve's throughput benchmarks use) and torchvision's usual ImageNet transforms; or a
timm model (``PEER_MODEL=timm:<name>``) as timm documents it: ``create_model``, and
``create_transform`` of its ``resolve_model_data_config``; or a Hugging Face transformers
classifier (``PEER_MODEL=hf:<directory>``) as transformers documents it: its
``AutoImageProcessor`` on the batch's images, then the model."""

from __future__ import annotations

import importlib
import io
import os
from typing import Any

import torch
import torchvision
from PIL import Image
from torchvision import transforms

MODEL = os.environ.get("PEER_MODEL", "resnet18")
PORT = int(os.environ.get("PEER_PORT", "8000"))
MAX_BATCH_SIZE = int(os.environ.get("PEER_MAX_BATCH_SIZE", "8"))
BATCH_TIMEOUT_S = float(os.environ.get("PEER_BATCH_TIMEOUT_S", "0.01"))

TIMM = MODEL.removeprefix("timm:") if MODEL.startswith("timm:") else None
HF = MODEL.removeprefix("hf:") if MODEL.startswith("hf:") else None


def build() -> torch.nn.Module:
    if HF is not None:
        transformers: Any = importlib.import_module("transformers")

        model: torch.nn.Module = transformers.AutoModelForImageClassification.from_pretrained(HF)
        return model.eval()
    if TIMM is not None:
        timm: Any = importlib.import_module("timm")

        built: torch.nn.Module = timm.create_model(TIMM, pretrained=False)
        return built.eval()
    classifier: torch.nn.Module = getattr(torchvision.models, MODEL)(weights=None)
    return classifier.eval()


def transform() -> Any:
    if HF is not None:
        transformers: Any = importlib.import_module("transformers")

        return transformers.AutoImageProcessor.from_pretrained(HF)
    if TIMM is not None:
        timm: Any = importlib.import_module("timm")

        return timm.data.create_transform(**timm.data.resolve_model_data_config(build()))
    return transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )


TRANSFORM = transform()


def to_tensor(data: bytes) -> Any:
    """One image as the model's batch takes it (a transformers model's: the PIL image, which
    its processor prepares with the batch)."""
    with Image.open(io.BytesIO(data)) as image:
        if HF is not None:
            return image.convert("RGB")
        tensor: torch.Tensor = TRANSFORM(image.convert("RGB"))
        return tensor


def classify(model: torch.nn.Module, batch: torch.Tensor) -> list[dict[str, Any]]:
    """Top-5 classes of each image in ``batch``."""
    with torch.inference_mode():
        logits = model(batch)
        scores, indices = getattr(logits, "logits", logits).softmax(dim=1).topk(5)
    return [
        {"predictions": [{"index": i, "score": s} for i, s in zip(row_i, row_s, strict=True)]}
        for row_i, row_s in zip(indices.tolist(), scores.tolist(), strict=True)
    ]

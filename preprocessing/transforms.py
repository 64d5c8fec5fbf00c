"""Resize, crop and normalize: torchvision's own functional transforms, batched where it pays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TransformConfig:
    """The evaluation transform of a classification model (as ``weights.transforms()``)."""

    crop_size: int = 224
    resize_size: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: InterpolationMode = InterpolationMode.BILINEAR

    def __post_init__(self) -> None:
        if self.crop_size < 1 or self.resize_size < 1:
            raise ValueError("crop_size and resize_size must be >= 1")
        if self.crop_size > self.resize_size:
            raise ValueError(
                f"the crop ({self.crop_size}) cannot be larger than the resize ({self.resize_size})"
            )


def resize_crop(image: torch.Tensor, config: TransformConfig) -> torch.Tensor:
    """Shorter side to ``resize_size`` (antialiased), then the centre ``crop_size`` square.

    Works on ``uint8[..., 3, H, W]`` on any device and keeps the dtype.
    """
    resized = F.resize(image, [config.resize_size], config.interpolation, antialias=True)
    cropped: torch.Tensor = F.center_crop(resized, [config.crop_size, config.crop_size])
    return cropped


def normalize_into(
    images: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, config: TransformConfig
) -> torch.Tensor:
    """Scale uint8 images to [0, 1], normalize with mean/std in fp32, write into ``out``.

    ``out`` keeps its dtype and memory format (e.g. bf16, channels_last): the model's input
    buffer is filled in place. Returns the filled ``out[:n]``.
    """
    batch = images if isinstance(images, torch.Tensor) else torch.stack(list(images))
    if batch.device != out.device:
        batch = batch.to(out.device, non_blocking=True)
    scaled = F.to_dtype(batch, torch.float32, scale=True)
    normalized = F.normalize(scaled, list(config.mean), list(config.std), inplace=True)
    target = out[: normalized.shape[0]]
    target.copy_(normalized)
    return target

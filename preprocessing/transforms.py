"""Resize, crop and normalize: a model's evaluation transform, on torch alone.

A classifier sees the centre crop (``resize_crop``); a detector or a segmenter must see the
whole image, so it is letterboxed instead (``letterbox``): resized to fit the square input
with its aspect ratio kept, placed at the top left, the rest filled with the mean colour
(zero once normalised), so that images of any size and aspect ratio share one batch.

The same arithmetic as torchvision's ``Resize(resize_size, antialias=True)``,
``CenterCrop(crop_size)``, ``ToDtype(float32, scale=True)`` and ``Normalize(mean, std)`` on
tensors (the tests hold them to it), done with torch's own ``interpolate`` rather than through
torchvision: importing torchvision imports every model and operator it ships, and with them
``torch._dynamo``: more than a second of every cold start for nothing that serves
(``benchmarks/results/coldstart-before-cards.md`` against ``coldstart.md``). Resizing a uint8
image with antialiased bilinear interpolation stays in uint8 on a CPU with AVX2 (torch's fast
path), as torchvision does.
"""

from __future__ import annotations

import enum
import functools
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.functional import interpolate

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Interpolation(enum.StrEnum):
    """How the resize samples: the tensor modes of torchvision's ``InterpolationMode``."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


@dataclass(frozen=True)
class TransformConfig:
    """The evaluation transform of a classification model (as ``weights.transforms()``)."""

    crop_size: int = 224
    resize_size: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: Interpolation = Interpolation.BILINEAR
    # The whole image, fitted into the crop_size square (detection, segmentation), instead of
    # the centre crop of its resize.
    letterbox: bool = False

    def __post_init__(self) -> None:
        if self.crop_size < 1 or self.resize_size < 1:
            raise ValueError("crop_size and resize_size must be >= 1")
        if self.crop_size > self.resize_size:
            raise ValueError(
                f"the crop ({self.crop_size}) cannot be larger than the resize ({self.resize_size})"
            )
        object.__setattr__(self, "interpolation", Interpolation(self.interpolation))


def resized_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """The size with the shorter side at ``short_side`` and the aspect ratio kept (the longer
    side rounded down)."""
    if height <= width:
        return short_side, int(short_side * width / height)
    return int(short_side * height / width), short_side


def _uint8_stays_uint8(mode: Interpolation, device: torch.device) -> bool:
    """Whether torch resizes uint8 directly (a vectorised kernel) rather than through float."""
    if device.type != "cpu":
        return mode in (Interpolation.NEAREST, Interpolation.NEAREST_EXACT)
    if mode is Interpolation.BILINEAR:
        vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        return vectorised or platform.machine() in ("aarch64", "arm64")
    return True  # nearest and bicubic have uint8 kernels of their own


def resize(image: torch.Tensor, short_side: int, mode: Interpolation) -> torch.Tensor:
    """``uint8`` or float ``[..., C, H, W]`` with its shorter side at ``short_side``
    (antialiased for bilinear and bicubic), in its own dtype, on its own device."""
    *lead, channels, height, width = image.shape
    size = resized_size(height, width, short_side)
    if size == (height, width) or image.numel() == 0:
        return image
    batch = image.reshape(-1, channels, height, width)
    if batch.shape[0] == 1 and batch.is_contiguous(memory_format=torch.channels_last):
        # A single HWC-ordered image: give the batch axis a stride of its own so that torch
        # keeps the output channels_last too (and skips a repacking copy for uint8).
        batch = batch.as_strided(batch.shape, (image.numel(), *batch.stride()[1:]))
    return _interpolate(batch, size, mode).reshape(*lead, channels, *size)


def _interpolate(batch: torch.Tensor, size: tuple[int, int], mode: Interpolation) -> torch.Tensor:
    """``[N, C, H, W]`` resized to ``size`` (antialiased for bilinear and bicubic), in its own
    dtype: uint8 through float only where torch has no uint8 kernel for the mode here."""
    dtype = batch.dtype
    cast = dtype not in (torch.float32, torch.float64) and not (
        dtype == torch.uint8 and _uint8_stays_uint8(mode, batch.device)
    )
    smooth = mode in (Interpolation.BILINEAR, Interpolation.BICUBIC)
    resized = interpolate(
        batch.float() if cast else batch, size=list(size), mode=mode.value,
        align_corners=False if smooth else None, antialias=smooth,
    )  # fmt: skip
    if cast:
        if mode is Interpolation.BICUBIC:
            resized = resized.clamp_(0, 255)
        resized = resized.round_().to(dtype)
    return resized


def center_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    """The centre ``size`` square of ``[..., H, W]`` (the image must be at least that big)."""
    height, width = image.shape[-2:]
    if height < size or width < size:
        raise ValueError(f"a {width}x{height} image has no {size}x{size} centre")
    top, left = round((height - size) / 2), round((width - size) / 2)
    return image[..., top : top + size, left : left + size]


def letterbox_size(height: int, width: int, size: int) -> tuple[int, int]:
    """The size of a ``height`` x ``width`` image fitted into a ``size`` square, its aspect
    ratio kept: its longer side becomes ``size``, the shorter one is rounded (at least 1)."""
    scale = size / max(height, width)
    return max(1, min(size, round(height * scale))), max(1, min(size, round(width * scale)))


def letterbox(image: torch.Tensor, config: TransformConfig) -> torch.Tensor:
    """``uint8[3, H, W]`` fitted into ``crop_size`` x ``crop_size`` (``letterbox_size``), at
    the top left, the rest the mean colour. Any device; keeps the dtype."""
    height, width = int(image.shape[-2]), int(image.shape[-1])
    target = letterbox_size(height, width, config.crop_size)
    if target != (height, width):
        resized = _interpolate(image.unsqueeze(0), target, config.interpolation)[0]
    else:
        resized = image
    size = config.crop_size
    fill = channel_constant(tuple(round(255 * m) for m in config.mean), image.dtype, image.device)
    canvas = fill.expand(3, size, size).clone()
    canvas[:, : target[0], : target[1]] = resized
    return canvas


@functools.lru_cache(maxsize=64)
def channel_constant(
    values: tuple[float, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a ``[C, 1, 1]`` tensor on ``device``, made once per device and dtype: a
    new one per batch would be a pageable host-to-device copy that waits for the stream, twice
    a batch. Never written: every batch reads the same one (a plain tensor, not an inference
    one, whether the first batch ran in inference mode or not)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device).view(-1, 1, 1)


def fit(image: torch.Tensor, config: TransformConfig) -> torch.Tensor:
    """The model's input image: letterboxed, or resized and centre-cropped."""
    return letterbox(image, config) if config.letterbox else resize_crop(image, config)


def decode_short_side(width: int, height: int, config: TransformConfig) -> int:
    """The short side the transform needs of an image (a JPEG decoded scaled down in the DCT
    must keep it): the resize's, or for a letterbox, what its short side is fitted to."""
    if not config.letterbox:
        return config.resize_size
    return min(letterbox_size(height, width, config.crop_size))


def resize_crop(image: torch.Tensor, config: TransformConfig) -> torch.Tensor:
    """Shorter side to ``resize_size`` (antialiased), then the centre ``crop_size`` square.

    Works on ``uint8[..., 3, H, W]`` on any device and keeps the dtype.
    """
    return center_crop(resize(image, config.resize_size, config.interpolation), config.crop_size)


def normalize_into(
    images: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor, config: TransformConfig
) -> torch.Tensor:
    """Scale uint8 images to [0, 1], normalize with mean/std in fp32, write into ``out``.

    ``out`` keeps its dtype and memory format (e.g. bf16, channels_last): the model's input
    buffer is filled in place. Returns the filled ``out[:n]``.
    """
    count = len(images)
    target = out[:count]
    mean = channel_constant(config.mean, torch.float32, out.device)
    std = channel_constant(config.std, torch.float32, out.device)
    if out.dtype == torch.float32 and all(image.device == out.device for image in images):
        # The same arithmetic in place in the input: no stacked copy, no float copy of it.
        for row, image in enumerate(images):
            target[row].copy_(image)
        return target.mul_(1.0 / 255).sub_(mean).div_(std)
    batch = images if isinstance(images, torch.Tensor) else torch.stack(list(images))
    if batch.device != out.device:
        batch = batch.to(out.device, non_blocking=True)
    # (x / 255 - mean) / std, in place on one float copy
    normalized = batch.to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)
    target.copy_(normalized)
    return target

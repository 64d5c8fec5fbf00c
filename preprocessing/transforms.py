"""Resize, crop and normalize: a model's own input transform, on torch alone.

What a model sees is its library's: the rule that fits an image to its input (``Fit``, worked
out per image as a ``Placement``), the interpolation and whether it antialiases, whether it
resizes the uint8 image or the float one, and the statistics it normalises with. A
classifier sees the centre crop (``resize_crop``); a model that sees the whole image gets its
pixels resized to its placement's content size (``fit``), placed in its canvas when the batch
is made (``normalize_into``), the rest of the canvas the model's padding (zero once
normalised, as torchvision pads).

The same arithmetic as torchvision's ``Resize``, ``CenterCrop``, ``ToDtype(float32,
scale=True)`` and ``Normalize`` on tensors, and as its detection transform's ``interpolate``
(bilinear, no antialiasing, on the float image), done with torch's own ``interpolate`` rather
than through torchvision: importing torchvision imports every model and operator it ships,
and with them ``torch._dynamo``: more than a second of every cold start for nothing that
serves (``benchmarks/results/coldstart-before-cards.md`` against ``coldstart.md``).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import interpolate

from preprocessing.placement import Fit, Placement, padded_to, place, resized_size

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Interpolation(enum.StrEnum):
    """How the resize samples: the tensor modes of torchvision's ``InterpolationMode``."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


class Resampler(enum.StrEnum):
    """Who resizes a whole image's uint8 pixels on the CPU: torch (torchvision's tensor
    arithmetic, in float as ``transforms.functional.resize`` does), torchvision's
    ``transforms.v2`` (torch's own uint8 kernels where it picks them: Hugging Face's image
    processors), OpenCV's ``cv2.resize`` (Ultralytics' letterbox), or Pillow (torchvision's
    transforms on a PIL image: timm, Ultralytics' classifiers). Each library rounds otherwise,
    a grey level here and there, which a model of sensitive weights can answer."""

    TORCH = "torch"
    TORCHVISION = "torchvision"
    OPENCV = "opencv"
    PILLOW = "pillow"


@dataclass(frozen=True)
class TransformConfig:
    """A model's input transform: how an image is fitted (``fit``, with ``crop_size``,
    ``resize_size``, ``max_size`` and ``size_divisible`` as each rule reads them, see
    ``preprocessing.placement``), how it is resampled (``interpolation``, ``antialias``, and
    ``float_resize``: on the float image rather than the uint8 one, as torchvision's detection
    transform does) and normalised (``mean``, ``std``); a canvas is padded with ``fill`` (in
    normalised units: 0, as torchvision pads). ``resampler``: who resizes an image's uint8 pixels
    on the CPU: torch, or the library a model's own pipeline resizes with (``Resampler``);
    ``crop_floor``: the centre crop's offsets floored (Hugging Face's image processors), not
    rounded (torchvision's)."""

    crop_size: int = 224
    resize_size: int = 256
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    interpolation: Interpolation = Interpolation.BILINEAR
    fit: Fit = Fit.CENTER_CROP
    max_size: int | None = None
    size_divisible: int = 1
    antialias: bool = True
    float_resize: bool = False
    fill: float = 0.0
    buckets: tuple[tuple[int, int], ...] = ()
    resampler: Resampler = Resampler.TORCH
    crop_floor: bool = False

    def __post_init__(self) -> None:
        if self.crop_size < 1 or self.resize_size < 1:
            raise ValueError("crop_size and resize_size must be >= 1")
        object.__setattr__(self, "interpolation", Interpolation(self.interpolation))
        object.__setattr__(self, "fit", Fit(self.fit))
        object.__setattr__(self, "resampler", Resampler(self.resampler))
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if self.fit is Fit.CENTER_CROP and self.crop_size > self.resize_size:
            raise ValueError(
                f"the crop ({self.crop_size}) cannot be larger than the resize ({self.resize_size})"
            )
        if self.max_size is not None and self.max_size < self.resize_size:
            raise ValueError(
                f"the longest side ({self.max_size}) cannot be shorter than the shortest "
                f"({self.resize_size})"
            )
        if self.size_divisible < 1:
            raise ValueError("size_divisible must be >= 1")
        buckets = tuple((int(height), int(width)) for height, width in self.buckets)
        if buckets and self.fit.fixed_canvas:
            raise ValueError(
                f"shared canvases apply only where the canvas follows the image's shape (FIT "
                f"min-max or shorter-side); FIT={self.fit} gives every image the same canvas"
            )
        # Each rounded up as the model pads (a detector's size_divisible).
        object.__setattr__(self, "buckets", tuple(sorted({
            (padded_to(height, self.size_divisible), padded_to(width, self.size_divisible))
            for height, width in buckets
        })))  # fmt: skip

    @property
    def letterbox(self) -> bool:
        return self.fit in (Fit.LETTERBOX, Fit.CENTERED_LETTERBOX)

    def placement(self, width: int, height: int) -> Placement:
        """Where an upright ``width`` x ``height`` image lies in this model's input."""
        return place(width, height, self.fit, crop_size=self.crop_size,
                     resize_size=self.resize_size, max_size=self.max_size,
                     size_divisible=self.size_divisible, buckets=self.buckets)  # fmt: skip

    @property
    def example_canvas(self) -> tuple[int, int]:
        """The canvas of a 640 x 480 photo: the shape a model is exported and probed at."""
        return self.placement(640, 480).canvas

    def as_dict(self) -> dict[str, object]:
        """Its fields as JSON values (a model card keeps them)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {name: ([list(each) if isinstance(each, tuple) else each for each in value]
                       if isinstance(value, tuple) else
                       str(value) if isinstance(value, enum.Enum) else value)
                for name, value in values.items()}  # fmt: skip


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


# The most bytes of float pixels a resize holds at once.
FLOAT_COPY_BYTES = 4 * 1024 * 1024


def _interpolate(
    batch: torch.Tensor, size: tuple[int, int], mode: Interpolation, antialias: bool = True
) -> torch.Tensor:
    """``[N, C, H, W]`` resized to ``size`` (antialiased for bilinear and bicubic unless
    ``antialias`` is off), in its own dtype: uint8 through float32 and rounded back, as
    torchvision's ``transforms.functional.resize`` (what the weights' ``transforms()`` call)
    does; torch's own uint8 kernels round otherwise, a grey level apart here and there."""
    dtype = batch.dtype
    smooth = mode in (Interpolation.BILINEAR, Interpolation.BICUBIC)
    options: dict[str, Any] = {"size": list(size), "mode": mode.value,
                               "align_corners": False if smooth else None,
                               "antialias": smooth and antialias}  # fmt: skip
    if dtype in (torch.float32, torch.float64) or not smooth:
        return interpolate(batch, **options)  # nearest copies pixels: exact in any dtype
    if options["antialias"]:
        resized = _separable(batch, size, options)
    else:
        resized = interpolate(batch.float(), **options)
    if mode is Interpolation.BICUBIC:
        resized = resized.clamp_(0, 255)
    return resized.round_().to(dtype)


def _separable(batch: torch.Tensor, size: tuple[int, int], options: dict[str, Any]) -> torch.Tensor:
    """An antialiased resize of integer pixels in float, across then down, as torch's own
    resize runs it (the same floats): across a band of rows at a time, so that the float copy
    of a large photo (four times its bytes, outgrowing what admission counts) is never whole."""
    count, channels, height, width = batch.shape
    across = torch.empty((count, channels, height, size[1]), device=batch.device)
    rows = max(1, FLOAT_COPY_BYTES // (4 * count * channels * width))
    for top in range(0, height, rows):
        band = batch[:, :, top : top + rows].float()
        across[:, :, top : top + rows] = interpolate(
            band, **(options | {"size": [band.shape[2], size[1]]})
        )
    return interpolate(across, **options)


def center_crop(image: torch.Tensor, size: int, floor: bool = False) -> torch.Tensor:
    """The centre ``size`` square of ``[..., H, W]`` (the image must be at least that big),
    its offsets rounded as torchvision's ``CenterCrop`` does, or ``floor``ed."""
    height, width = image.shape[-2:]
    if height < size or width < size:
        raise ValueError(f"a {width}x{height} image has no {size}x{size} centre")
    offset = math.floor if floor else round
    top, left = offset((height - size) / 2), offset((width - size) / 2)
    return image[..., top : top + size, left : left + size]


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


def fit(image: torch.Tensor, config: TransformConfig, placement: Placement) -> torch.Tensor:
    """The pixels the model sees of ``uint8[..., 3, H, W]`` (the upright image, maybe decoded
    smaller than it is): its centre crop, or the whole image resized to its placement's
    content size (float, on the 0-255 scale, where the model resizes the float image). Any
    device."""
    if config.fit is Fit.CENTER_CROP:
        return resize_crop(image, config)
    if config.float_resize:
        image = image.float()
    if tuple(image.shape[-2:]) == placement.content:
        return image
    if config.resampler is Resampler.OPENCV and _on_cpu_uint8(image):
        return _opencv_resized(image, placement.content)
    if config.resampler is Resampler.PILLOW and _on_cpu_uint8(image):
        return _pillow_resized(image, placement.content, config.interpolation)
    if config.resampler is Resampler.TORCHVISION:
        return _torchvision_resized(image, placement.content, config.interpolation)
    lead = image.shape[:-3]
    batch = image.reshape(-1, *image.shape[-3:])
    resized = _interpolate(batch, placement.content, config.interpolation, config.antialias)
    return resized.reshape(*lead, *resized.shape[-3:])


def _on_cpu_uint8(image: torch.Tensor) -> bool:
    return image.device.type == "cpu" and image.dtype == torch.uint8 and image.ndim == 3


def _opencv_resized(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``uint8[3, H, W]`` on the CPU resized to ``size`` by ``cv2.resize`` (``INTER_LINEAR``),
    channels last in memory."""
    import cv2

    pixels = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
    resized = cv2.resize(pixels, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return torch.from_numpy(resized).permute(2, 0, 1)


def decode_short_side(width: int, height: int, config: TransformConfig) -> int | None:
    """The short side a JPEG decoded scaled down in the DCT must keep for this transform
    (None: decoded whole): the resize's, or the short side of the content. Only before an
    antialiased resize, which averages what the DCT's scaling averages; a model that samples
    the full image without antialiasing (torchvision's detectors) must be given the full
    image to sample."""
    if not config.antialias or config.resampler is not Resampler.TORCH:
        return None  # a library's own resize is given the image its library decodes: whole
    if config.fit is Fit.CENTER_CROP:
        return config.resize_size
    return min(config.placement(width, height).content)


def resize_crop(image: torch.Tensor, config: TransformConfig) -> torch.Tensor:
    """Shorter side to ``resize_size`` (antialiased), then the centre ``crop_size`` square.

    Works on ``uint8[..., 3, H, W]`` on any device and keeps the dtype.
    """
    floor = config.crop_floor
    size = resized_size(int(image.shape[-2]), int(image.shape[-1]), config.resize_size)
    if config.resampler is Resampler.PILLOW and _on_cpu_uint8(image):
        return center_crop(_pillow_resized(image, size, config.interpolation), config.crop_size,
                           floor)  # fmt: skip
    if config.resampler is Resampler.TORCHVISION:
        resized = _torchvision_resized(image, size, config.interpolation)
        return center_crop(resized, config.crop_size, floor)
    return center_crop(resize(image, config.resize_size, config.interpolation), config.crop_size,
                       floor)  # fmt: skip


def _torchvision_resized(
    image: torch.Tensor, size: tuple[int, int], interpolation: Interpolation
) -> torch.Tensor:
    """``[..., 3, H, W]`` resized to ``size`` by ``torchvision.transforms.v2.functional``
    (antialiased), which resizes uint8 on the CPU with torch's own uint8 kernels where it
    trusts them and in float elsewhere."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional import resize as v2_resize

    if size == (int(image.shape[-2]), int(image.shape[-1])):
        return image
    resized: torch.Tensor = v2_resize(image, list(size), InterpolationMode(interpolation.value),
                                      antialias=True)  # fmt: skip
    return resized


def _pillow_resized(
    image: torch.Tensor, size: tuple[int, int], interpolation: Interpolation
) -> torch.Tensor:
    """``uint8[3, H, W]`` resized to ``size`` (height, width) by Pillow (what torchvision's
    ``Resize`` runs on a PIL image), channels last in memory."""
    from PIL import Image

    if size == (int(image.shape[-2]), int(image.shape[-1])):
        return image
    modes = {Interpolation.NEAREST: Image.Resampling.NEAREST,
             Interpolation.BILINEAR: Image.Resampling.BILINEAR,
             Interpolation.BICUBIC: Image.Resampling.BICUBIC}  # fmt: skip
    picture = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
    mode = modes.get(interpolation, Image.Resampling.BILINEAR)
    resized = picture.resize((size[1], size[0]), mode)
    return torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1)


def normalize_into(
    images: torch.Tensor | Sequence[torch.Tensor],
    out: torch.Tensor,
    config: TransformConfig,
    placements: Sequence[Placement] | None = None,
) -> torch.Tensor:
    """Scale images (uint8, or float on the 0-255 scale) to [0, 1], normalize with mean/std
    in fp32, write into ``out``: each at its placement's place in the canvas, the rest of the
    canvas ``config.fill``.

    ``out`` keeps its dtype and memory format (e.g. bf16, channels_last): the model's input
    buffer is filled in place. Returns the filled ``out[:n]``.
    """
    count = len(images)
    target = out[:count]
    mean = channel_constant(config.mean, torch.float32, out.device)
    std = channel_constant(config.std, torch.float32, out.device)
    padded = placements is not None and any(each.padded for each in placements)
    if padded:
        assert placements is not None
        target.fill_(config.fill)
        for row, (image, where) in enumerate(zip(images, placements, strict=True)):
            height, width = where.content
            area = target[row, :, where.top : where.top + height, where.left : where.left + width]
            if out.dtype == torch.float32 and image.device == out.device:
                area.copy_(image).div_(255).sub_(mean).div_(std)
            else:
                area.copy_(image.to(out.device, torch.float32).div(255).sub_(mean).div_(std))
        return target
    if out.dtype == torch.float32 and all(image.device == out.device for image in images):
        # The same arithmetic in place in the input: no stacked copy, no float copy of it.
        for row, image in enumerate(images):
            target[row].copy_(image)
        return target.div_(255).sub_(mean).div_(std)
    batch = images if isinstance(images, torch.Tensor) else torch.stack(list(images))
    if batch.device != out.device:
        batch = batch.to(out.device, non_blocking=True)
    # (x / 255 - mean) / std, in place on one float copy
    normalized = batch.to(torch.float32).div(255).sub_(mean).div_(std)
    target.copy_(normalized)
    return target

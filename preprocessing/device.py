"""Batched JPEG decoding on a device (nvjpeg on CUDA), with per-image fallbacks.

One ``decode_jpeg(list, device=...)`` call decodes a whole batch. If it fails, the images are
retried one by one on the device, and those the device decoder rejects (CMYK, progressive
oddities, corrupt data) are decoded on the CPU; only an image that no decoder can read fails,
and it fails alone. Every image the CPU decoded instead is counted (``DeviceDecoded``), so that
a device decoder that fails quietly shows on a dashboard. The same code runs with
``device="cpu"``, which is how it is tested.

Any exception of the device decoder counts as its failure, not only ``RuntimeError``: when
libnvjpeg cannot be loaded, torchvision raises others (``AttributeError`` among them).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from preprocessing.decode import apply_orientation, as_byte_tensor, decode_cpu
from preprocessing.errors import PreprocessingError
from preprocessing.formats import Buffer, ImageHeader

logger = logging.getLogger("batchserve")

Decoded = torch.Tensor | BaseException


@dataclass(slots=True)
class DeviceDecoded:
    """One result or error per image, and how many the CPU decoded in the device's place."""

    results: list[Decoded] = field(default_factory=list)
    fallbacks: int = 0


def decode_jpegs(
    images: Sequence[tuple[Buffer, ImageHeader]], device: torch.device
) -> DeviceDecoded:
    """Decode JPEGs to upright ``uint8[3, H, W]`` tensors, one result or error per image.

    Results are on ``device``, except images that needed the CPU fallback, which stay on the
    CPU (the caller resizes them there and copies only the small crop).
    """
    if not images:
        return DeviceDecoded()
    data = [as_byte_tensor(buffer) for buffer, _ in images]
    try:
        decoded = _decode(data, device)
    except Exception as exc:
        logger.debug("batched JPEG decode failed (%s); retrying one by one", exc)
        outcome = DeviceDecoded()
        for tensor, (buffer, header) in zip(data, images, strict=True):
            result, fell_back = _decode_one(tensor, buffer, header, device)
            outcome.results.append(result)
            outcome.fallbacks += fell_back
        return outcome
    return DeviceDecoded([
        apply_orientation(image, header.orientation)
        for image, (_, header) in zip(decoded, images, strict=True)
    ])  # fmt: skip


def probe_decoder(device: torch.device) -> str | None:
    """Why the device's JPEG decoder cannot serve (None: it decoded a small image right)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 60)).save(buffer, "JPEG", quality=95)
    data = buffer.getvalue()
    try:
        (image,) = _decode([as_byte_tensor(data)], device)
        shape, colour = tuple(image.shape), image[:, 4, 8].cpu().tolist()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if shape != (3, 8, 16) or abs(colour[0] - 200) > 8 or abs(colour[2] - 60) > 8:
        return f"a 16x8 test image decoded as {list(shape)} with the colour {colour}"
    return None


def _decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # Imported here: torchvision is needed for nvjpeg only, and importing it costs seconds.
    from torchvision.io import ImageReadMode, decode_jpeg

    result: list[torch.Tensor] = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return result


def _decode_one(
    tensor: torch.Tensor, buffer: Buffer, header: ImageHeader, device: torch.device
) -> tuple[Decoded, int]:
    try:
        (image,) = _decode([tensor], device)
        return apply_orientation(image, header.orientation), 0
    except Exception:
        pass
    try:
        # The CPU decoder reads more (CMYK, ...) and applies the EXIF orientation itself.
        return decode_cpu(buffer, header), 1
    except PreprocessingError as exc:
        return exc, 1

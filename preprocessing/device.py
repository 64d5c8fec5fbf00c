"""Batched JPEG decoding on a device (nvjpeg on CUDA), with per-image fallbacks.

One ``decode_jpeg(list, device=...)`` call decodes a whole batch. If it fails, the images are
retried one by one on the device, and those the device decoder rejects (CMYK, progressive
oddities, corrupt data) are decoded on the CPU; only an image that no decoder can read fails,
and it fails alone. The same code runs with ``device="cpu"``, which is how it is tested.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from preprocessing.decode import apply_orientation, as_byte_tensor, decode_cpu
from preprocessing.errors import PreprocessingError
from preprocessing.formats import Buffer, ImageHeader

logger = logging.getLogger("batchserve")

Decoded = torch.Tensor | BaseException


def decode_jpegs(
    images: Sequence[tuple[Buffer, ImageHeader]], device: torch.device
) -> list[Decoded]:
    """Decode JPEGs to upright ``uint8[3, H, W]`` tensors, one result or error per image.

    Results are on ``device``, except images that needed the CPU fallback, which stay on the
    CPU (the caller resizes them there and copies only the small crop).
    """
    if not images:
        return []
    data = [as_byte_tensor(buffer) for buffer, _ in images]
    try:
        decoded = _decode(data, device)
    except RuntimeError as exc:
        logger.debug("batched JPEG decode failed (%s); retrying one by one", exc)
        return [
            _decode_one(tensor, buffer, header, device)
            for tensor, (buffer, header) in zip(data, images, strict=True)
        ]
    return [
        apply_orientation(image, header.orientation)
        for image, (_, header) in zip(decoded, images, strict=True)
    ]


def _decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # Imported here: torchvision is needed for nvjpeg only, and importing it costs seconds.
    from torchvision.io import ImageReadMode, decode_jpeg

    result: list[torch.Tensor] = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    return result


def _decode_one(
    tensor: torch.Tensor, buffer: Buffer, header: ImageHeader, device: torch.device
) -> Decoded:
    try:
        (image,) = _decode([tensor], device)
        return apply_orientation(image, header.orientation)
    except RuntimeError:
        pass
    try:
        # The CPU decoder reads more (CMYK, ...) and applies the EXIF orientation itself.
        return decode_cpu(buffer, header)
    except PreprocessingError as exc:
        return exc

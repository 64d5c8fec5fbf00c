"""Per-request preprocessing, run in a worker thread before the request joins a batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from preprocessing.decode import decode_cpu
from preprocessing.formats import Buffer, ImageFormat, ImageHeader, ImageLimits, read_header
from preprocessing.transforms import TransformConfig, resize_crop


@dataclass(slots=True)
class PreparedImage:
    """An image ready to be batched.

    ``pixels`` is the ``uint8[3, crop, crop]`` crop when it was decoded on the CPU; otherwise
    ``data`` holds the encoded bytes for a device decoder (JPEG on a GPU).
    """

    header: ImageHeader
    pixels: torch.Tensor | None = None
    data: Buffer | None = None
    decode_s: float = 0.0


def prepare(
    data: Buffer,
    transform: TransformConfig,
    limits: ImageLimits | None = None,
    *,
    device_decodes_jpeg: bool = False,
) -> PreparedImage:
    """Check the header (format, size limits) and, unless a device decodes it, decode,
    resize and crop on the CPU so that this work overlaps the batching window."""
    started = time.perf_counter()
    header = read_header(data, limits)
    if device_decodes_jpeg and header.format is ImageFormat.JPEG:
        return PreparedImage(header, data=data, decode_s=time.perf_counter() - started)
    pixels = resize_crop(decode_cpu(data, header), transform)
    return PreparedImage(header, pixels=pixels, decode_s=time.perf_counter() - started)

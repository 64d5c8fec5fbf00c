"""Per-request preprocessing, run in a worker thread before the request joins a batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from preprocessing.decode import decode_cpu
from preprocessing.formats import Buffer, ImageFormat, ImageHeader, ImageLimits, read_header
from preprocessing.transforms import TransformConfig, decode_short_side, fit


@dataclass(slots=True)
class PreparedImage:
    """An image ready to be batched, in one of three forms:

    - ``pixels``: the ``uint8[3, crop, crop]`` crop, decoded on the CPU (or sent decoded);
    - ``data``: the encoded bytes, for a device decoder (JPEG on a GPU);
    - ``normalized``: the model's ``float32[3, crop, crop]`` input, sent ready by a client.
    """

    header: ImageHeader
    pixels: torch.Tensor | None = None
    data: Buffer | None = None
    decode_s: float = 0.0
    normalized: torch.Tensor | None = None


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
    width, height = oriented_size(header)
    short_side = decode_short_side(width, height, transform)
    pixels = fit(decode_cpu(data, header, short_side), transform)
    return PreparedImage(header, pixels=pixels, decode_s=time.perf_counter() - started)


def prepare_pixels(
    pixels: torch.Tensor, transform: TransformConfig, limits: ImageLimits | None = None
) -> PreparedImage:
    """An image sent already decoded, ``uint8[3, H, W]``: checked against the same limits as
    an encoded one, then resized and cropped."""
    started = time.perf_counter()
    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    (limits or ImageLimits()).check(width, height)
    crop = fit(pixels.contiguous(), transform)
    header = ImageHeader(ImageFormat.RAW, width, height)
    return PreparedImage(header, pixels=crop, decode_s=time.perf_counter() - started)


def oriented_size(header: ImageHeader) -> tuple[int, int]:
    """The image's width and height once upright (EXIF orientations 5 to 8 turn it)."""
    if header.orientation in (5, 6, 7, 8):
        return header.height, header.width
    return header.width, header.height


def prepare_normalized(tensor: torch.Tensor) -> PreparedImage:
    """The model's input for one image, ``float32[3, crop, crop]``, sent ready."""
    header = ImageHeader(ImageFormat.RAW, int(tensor.shape[-1]), int(tensor.shape[-2]))
    return PreparedImage(header, normalized=tensor)

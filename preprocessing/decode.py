"""Decode an image to an upright 3-channel uint8 tensor on the CPU."""

from __future__ import annotations

import math

import numpy as np
import simplejpeg
import torch
from PIL import Image

from preprocessing.errors import InvalidImageError, UnsupportedFormatError
from preprocessing.formats import Buffer, ImageFormat, ImageHeader, open_image

_SIXTEEN_BIT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


def as_byte_tensor(data: Buffer) -> torch.Tensor:
    """A 1-D uint8 tensor over ``data`` (no copy for a bytearray)."""
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch wants a writable buffer
    return torch.frombuffer(data, dtype=torch.uint8)


def decode_cpu(data: Buffer, header: ImageHeader, short_side: int | None = None) -> torch.Tensor:
    """Decode to ``uint8[3, H, W]`` RGB with the header's EXIF orientation applied (the one
    the image's placement was worked out from).

    JPEG goes through libjpeg-turbo (simplejpeg), the other formats (and the JPEGs libjpeg-turbo
    cannot convert to RGB, such as CMYK) through Pillow. A JPEG at least four times
    ``short_side`` (the resize target) on its short side is decoded already scaled down by
    libjpeg-turbo (1/2, 1/4 or 1/8, in the DCT), never below twice ``short_side``, so that the
    antialiased resize still makes the last halving as it would from the full image: a 12 MP
    phone photo costs about 40% of a full decode.
    """
    if header.format is ImageFormat.JPEG:
        factor = dct_factor(header, short_side)
        try:
            pixels = simplejpeg.decode_jpeg(
                data, colorspace="RGB", min_height=math.ceil(header.height / factor),
                min_width=math.ceil(header.width / factor),
            )  # fmt: skip
        except ValueError:  # corrupt, or a colour space it does not convert (CMYK, YCCK)
            pass
        else:
            upright = torch.from_numpy(pixels).permute(2, 0, 1)
            return apply_orientation(upright, header.orientation)
    pixels = np.array(_decode_with_pillow(data, header.format))
    return apply_orientation(torch.from_numpy(pixels).permute(2, 0, 1), header.orientation)


def dct_factor(header: ImageHeader, short_side: int | None) -> int:
    """How many times smaller libjpeg-turbo decodes this JPEG: the largest power of two up to
    8 that keeps its short side at least twice ``short_side``, once it is four times it."""
    short = min(header.width, header.height)
    if short_side is None or short < 4 * short_side:
        return 1
    factor = 2
    while factor < 8 and math.ceil(short / (factor * 2)) >= 2 * short_side:
        factor *= 2
    return factor


def apply_orientation(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """Make ``image[..., H, W]`` upright for an EXIF orientation (1..8), like Pillow's
    ``ImageOps.exif_transpose``: libjpeg-turbo and nvjpeg decode the stored pixels as they are."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return torch.rot90(image, k=-1, dims=(-2, -1))
    if orientation == 7:
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return torch.rot90(image, k=1, dims=(-2, -1))
    return image


def _decode_with_pillow(data: Buffer, fmt: ImageFormat) -> Image.Image:
    image = open_image(data, fmt)
    try:
        image.load()
        return to_rgb(image)
    except UnsupportedFormatError:
        raise
    except Exception as exc:  # decoders fail on garbage in many ways (struct.error, ...)
        raise InvalidImageError(f"the {fmt.name} data is corrupt or truncated") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: 16-bit scaled (not clipped), alpha dropped, CMYK converted."""
    if image.mode == "RGB":
        return image
    if image.mode in _SIXTEEN_BIT_MODES:
        # Pillow's own conversion clips 16-bit values to 255, which turns most images white.
        image = image.convert("I").point(lambda value: value * (1 / 257) + 0.5).convert("L")
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise UnsupportedFormatError(
            f"images in colour mode {image.mode} are not supported"
        ) from exc

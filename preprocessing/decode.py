"""Decode an image to an upright 3-channel uint8 tensor on the CPU."""

from __future__ import annotations

import math

import torch
from PIL import Image, ImageOps
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from preprocessing.errors import InvalidImageError, UnsupportedFormatError
from preprocessing.formats import Buffer, ImageFormat, ImageHeader, open_image

_SIXTEEN_BIT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


def as_byte_tensor(data: Buffer) -> torch.Tensor:
    """A 1-D uint8 tensor over ``data`` (no copy for a bytearray)."""
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch wants a writable buffer
    return torch.frombuffer(data, dtype=torch.uint8)


def decode_cpu(data: Buffer, header: ImageHeader, short_side: int | None = None) -> torch.Tensor:
    """Decode to ``uint8[3, H, W]`` RGB with the EXIF orientation applied.

    JPEG goes through libjpeg-turbo (torchvision); the other formats through Pillow, because
    torchvision's PNG decoder crashes the process on some corrupt files. A JPEG at least four
    times ``short_side`` (the resize target) on its short side is decoded already scaled down
    by libjpeg (1/2, 1/4 or 1/8, in the DCT: Pillow's draft mode), never below twice
    ``short_side``, so that the antialiased resize still makes the last halving as it would
    from the full image: a 12 MP phone photo costs about 40% of a full decode.
    """
    if (
        header.format is ImageFormat.JPEG
        and short_side is not None
        and (min(header.width, header.height) >= 4 * short_side)
    ):
        scaled: torch.Tensor = pil_to_tensor(_decode_jpeg_scaled(data, header, short_side))
        return scaled
    if header.format is ImageFormat.JPEG:
        try:
            image: torch.Tensor = decode_jpeg(
                as_byte_tensor(data), mode=ImageReadMode.RGB, apply_exif_orientation=True
            )
            return image
        except Exception as exc:
            # The message holds the decoder's source path: keep it out of client responses.
            raise InvalidImageError("the JPEG data is corrupt or truncated") from exc
    pixels: torch.Tensor = pil_to_tensor(_decode_with_pillow(data, header.format))
    return pixels


def _decode_jpeg_scaled(data: Buffer, header: ImageHeader, short_side: int) -> Image.Image:
    image = open_image(data, ImageFormat.JPEG)
    scale = 2 * short_side / min(header.width, header.height)
    # Pillow picks the largest reduction that still gives at least this size.
    image.draft("RGB", (math.ceil(header.width * scale), math.ceil(header.height * scale)))
    try:
        image.load()
        image = ImageOps.exif_transpose(image) or image
        return to_rgb(image)
    except Exception as exc:
        raise InvalidImageError("the JPEG data is corrupt or truncated") from exc


def _decode_with_pillow(data: Buffer, fmt: ImageFormat) -> Image.Image:
    image = open_image(data, fmt)
    try:
        image.load()
        image = ImageOps.exif_transpose(image) or image
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

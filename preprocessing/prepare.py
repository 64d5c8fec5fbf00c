"""Per-request preprocessing, run in a worker thread before the request joins a batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from preprocessing.decode import decode_cpu
from preprocessing.errors import ImageTooLargeError, InvalidImageError
from preprocessing.formats import Buffer, ImageFormat, ImageHeader, ImageLimits, read_header
from preprocessing.placement import Placement
from preprocessing.transforms import TransformConfig, decode_short_side, fit


@dataclass(slots=True)
class PreparedImage:
    """An image ready to be batched, in one of three forms:

    - ``pixels``: what the model sees of it (its centre crop, or its resized content), decoded
      on the CPU (or sent decoded): uint8, or float on the 0-255 scale;
    - ``data``: the encoded bytes, for a device decoder (JPEG on a GPU);
    - ``normalized``: the model's ``float32[3, H, W]`` input, sent ready by a client.

    ``placement`` is where it lies in the model's input: its canvas decides which images it
    may share a batch with, and its answers map back to its own pixels through it.
    """

    header: ImageHeader
    placement: Placement
    pixels: torch.Tensor | None = None
    data: Buffer | None = None
    decode_s: float = 0.0
    normalized: torch.Tensor | None = None

    @property
    def canvas(self) -> tuple[int, int]:
        """The input tensor's ``(height, width)``: the batch this image may join."""
        return self.placement.canvas


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
    width, height = oriented_size(header)
    placement = placed(transform, width, height, limits)
    if device_decodes_jpeg and header.format is ImageFormat.JPEG:
        return PreparedImage(header, placement, data=data, decode_s=time.perf_counter() - started)
    short_side = decode_short_side(width, height, transform)
    pixels = fit(decode_cpu(data, header, short_side), transform, placement)
    return PreparedImage(header, placement, pixels=pixels, decode_s=time.perf_counter() - started)


def placed(
    transform: TransformConfig, width: int, height: int, limits: ImageLimits | None
) -> Placement:
    """The image's placement, its resized content within the pixel limit (an extreme aspect
    ratio would explode when its shorter side is scaled up)."""
    placement = transform.placement(width, height)
    content = placement.content_width * placement.content_height
    if content > (limits or ImageLimits()).max_pixels:
        raise ImageTooLargeError(
            f"the image's aspect ratio ({width}x{height}) is too extreme to resize"
        )
    return placement


def prepare_pixels(
    pixels: torch.Tensor, transform: TransformConfig, limits: ImageLimits | None = None
) -> PreparedImage:
    """An image sent already decoded, ``uint8[3, H, W]``: checked against the same limits as
    an encoded one, then resized and cropped."""
    started = time.perf_counter()
    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    (limits or ImageLimits()).check(width, height)
    placement = placed(transform, width, height, limits)
    # Resized from the client's array as it lies (channels last): no whole copy of it first.
    crop = fit(pixels, transform, placement)
    header = ImageHeader(ImageFormat.RAW, width, height)
    return PreparedImage(header, placement, pixels=crop, decode_s=time.perf_counter() - started)


def oriented_size(header: ImageHeader) -> tuple[int, int]:
    """The image's width and height once upright (EXIF orientations 5 to 8 turn it)."""
    if header.orientation in (5, 6, 7, 8):
        return header.height, header.width
    return header.width, header.height


def prepare_normalized(tensor: torch.Tensor, transform: TransformConfig) -> PreparedImage:
    """The model's input for one image, ``float32[3, H, W]``, sent ready: answered in its own
    pixels. A model of one canvas takes that canvas; one whose canvas follows the image's size
    takes sides that are multiples of its ``size_divisible``."""
    height, width = int(tensor.shape[-2]), int(tensor.shape[-1])
    if transform.fit.fixed_canvas:
        expected = transform.example_canvas
        if (height, width) != expected:
            raise InvalidImageError(
                f"a tensor must have shape [N, 3, {expected[0]}, {expected[1]}]"
            )
    elif height % transform.size_divisible or width % transform.size_divisible:
        raise InvalidImageError(
            f"a tensor's height and width must be multiples of {transform.size_divisible}"
        )
    header = ImageHeader(ImageFormat.RAW, width, height)
    placement = Placement(width, height, width, height, width, height)
    return PreparedImage(header, placement, normalized=tensor)

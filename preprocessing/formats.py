"""Recognise an image from its first bytes and read its size without decoding it."""

from __future__ import annotations

import enum
import io
import warnings
from dataclasses import dataclass

from PIL import ExifTags, Image, PngImagePlugin

from preprocessing.errors import ImageTooLargeError, InvalidImageError, UnsupportedFormatError

# Our own limit is checked from the header before anything is decoded (see ``read_header``).
# Pillow's bomb check stays in place behind it, as a bound that holds whatever the settings
# say: it refuses to open an image of more than twice ``Image.MAX_IMAGE_PIXELS`` (about 179
# million pixels); its warning below that is ours to give, as a 413.

Buffer = bytes | bytearray | memoryview


class ImageFormat(enum.StrEnum):
    JPEG = "jpeg"
    PNG = "png"
    WEBP = "webp"
    GIF = "gif"
    BMP = "bmp"
    RAW = "raw"  # pixels sent already decoded (a tensor), never sniffed from bytes


# Formats we recognise but do not serve: a clear 415 rather than "not an image".
_UNSUPPORTED_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
)

_PIL_FORMAT = {
    ImageFormat.JPEG: "JPEG",
    ImageFormat.PNG: "PNG",
    ImageFormat.WEBP: "WEBP",
    ImageFormat.GIF: "GIF",
    ImageFormat.BMP: "BMP",
}

_ORIENTATION_TAG = ExifTags.Base.Orientation


def sniff(data: Buffer) -> ImageFormat:
    """The image format of ``data``, from its signature.

    Raises ``UnsupportedFormatError`` for known formats we do not decode and
    ``InvalidImageError`` for anything else that is not an image.
    """
    head = bytes(data[:16])
    if not head:
        raise InvalidImageError("the request body is empty")
    if head.startswith(b"\xff\xd8\xff"):
        return ImageFormat.JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return ImageFormat.PNG
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return ImageFormat.WEBP
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return ImageFormat.GIF
    if head.startswith(b"BM"):
        return ImageFormat.BMP
    for signature, name in _UNSUPPORTED_SIGNATURES:
        if head.startswith(signature):
            raise UnsupportedFormatError(f"{name} images are not supported; send JPEG, PNG or WebP")
    if head[4:8] == b"ftyp":
        raise UnsupportedFormatError("HEIC/AVIF images are not supported; send JPEG, PNG or WebP")
    raise InvalidImageError(
        "the request body is not a recognised image (JPEG, PNG, WebP, GIF, BMP)"
    )


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What the header says: format, stored size, EXIF orientation (1 = upright)."""

    format: ImageFormat
    width: int
    height: int
    orientation: int = 1


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Refuse images before decoding when they declare more than this (or less).

    ``max_pixels`` bounds the decoded image; ``resize_size`` lets us bound the resized image
    too, since an extreme aspect ratio (1 x 1,000,000) would explode when its shorter side is
    scaled up. ``min_side`` refuses images too small to classify (a 1x1 "image" is noise).
    """

    max_pixels: int = 40_000_000
    resize_size: int = 256
    min_side: int = 1

    def check(self, width: int, height: int) -> None:
        if width < 1 or height < 1:
            raise InvalidImageError("the image declares an empty size")
        if min(width, height) < self.min_side:
            raise InvalidImageError(
                f"the image is {width}x{height}; both sides must be at least {self.min_side} pixels"
            )
        if width * height > self.max_pixels:
            raise ImageTooLargeError(
                f"the image has {width}x{height} pixels; at most {self.max_pixels} are allowed"
            )
        short, long = min(width, height), max(width, height)
        resized_pixels = self.resize_size * self.resize_size * long / short
        if resized_pixels > self.max_pixels:
            raise ImageTooLargeError(
                f"the image's aspect ratio ({width}x{height}) is too extreme to resize"
            )


def open_image(data: Buffer, fmt: ImageFormat) -> Image.Image:
    """Open lazily with Pillow: the header is parsed, the pixels are not decoded yet."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=[_PIL_FORMAT[fmt]])
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"the {fmt.name} image declares too many pixels") from exc
    except Exception as exc:  # UnidentifiedImageError, OSError, struct.error, ...
        raise InvalidImageError(f"the {fmt.name} header is corrupt") from exc


def read_header(data: Buffer, limits: ImageLimits | None = None) -> ImageHeader:
    """Sniff the format, read the size and check it against ``limits``, then read the EXIF
    orientation: nothing is decoded before the limits are checked, nor by reading the
    orientation."""
    fmt = sniff(data)
    image = open_image(data, fmt)
    (limits or ImageLimits()).check(image.width, image.height)
    return ImageHeader(fmt, image.width, image.height, exif_orientation(image))


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation (1..8) of a lazily opened image; 1 when absent or invalid. A PNG's
    is read only from an eXIf chunk before its pixels (Pillow would decode the whole image to
    look for one after them), and decoding applies this orientation, not another it finds."""
    if isinstance(image, PngImagePlugin.PngImageFile) and "exif" not in image.info:
        return 1
    try:
        value = image.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # a corrupt EXIF block must not fail an otherwise fine image
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1

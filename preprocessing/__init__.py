"""Bytes to model input: format sniffing, header checks, decoding, resize/crop/normalize."""

from __future__ import annotations

from preprocessing.decode import decode_cpu, to_rgb
from preprocessing.errors import (
    ImageTooLargeError,
    InvalidImageError,
    PreprocessingError,
    UnsupportedFormatError,
)
from preprocessing.formats import (
    Buffer,
    ImageFormat,
    ImageHeader,
    ImageLimits,
    read_header,
    sniff,
)
from preprocessing.placement import Fit, Placement
from preprocessing.prepare import (
    PreparedImage,
    oriented_size,
    prepare,
    prepare_normalized,
    prepare_pixels,
)
from preprocessing.transforms import TransformConfig, fit, normalize_into, resize_crop

__all__ = [
    "Buffer",
    "Fit",
    "ImageFormat",
    "ImageHeader",
    "ImageLimits",
    "ImageTooLargeError",
    "InvalidImageError",
    "Placement",
    "PreparedImage",
    "PreprocessingError",
    "TransformConfig",
    "UnsupportedFormatError",
    "decode_cpu",
    "fit",
    "normalize_into",
    "oriented_size",
    "prepare",
    "prepare_normalized",
    "prepare_pixels",
    "read_header",
    "resize_crop",
    "sniff",
    "to_rgb",
]

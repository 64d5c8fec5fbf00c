"""Synthetic inputs for warm-up: real JPEG bytes, so warm-up runs the path requests take."""

from __future__ import annotations

import functools
import io

from PIL import Image


@functools.cache
def synthetic_jpeg(crop_size: int) -> bytes:
    """A flat-coloured JPEG a little larger than the crop (decoded, resized and cropped like a
    real upload; on a GPU, decoded by nvjpeg)."""
    size = crop_size + 16
    buffer = io.BytesIO()
    Image.new("RGB", (size + 8, size), (128, 100, 90)).save(buffer, "JPEG")
    return buffer.getvalue()

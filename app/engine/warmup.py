"""Synthetic photos for warm-up and the start-up check: real JPEG bytes, so that both run the
path requests take (decode, resize, crop; on a GPU, nvjpeg), and varied enough that a model's
answers differ between them."""

from __future__ import annotations

import functools
import io
import random

from PIL import Image, ImageDraw, ImageFilter

# Typical web and dataset photo sizes (ImageNet's validation images average about 500x400).
SIZES = [(500, 375), (640, 480), (375, 500), (800, 600), (500, 333), (1024, 768)]


def synthetic_photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth shapes over a gradient, blurred, with sensor-like noise: it compresses and
    decodes like a photograph (about 60-200 KB at 640x480, quality 90), unlike flat colour."""
    rng = random.Random(seed)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rng.randrange(width), rng.randrange(height)
        radius = rng.randrange(10, max(11, min(width, height) // 3))
        colour = tuple(rng.randrange(256) for _ in range(3))
        box = (x - radius, y - radius, x + radius, y + radius)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(1.0, 3.0)))
    noise = Image.effect_noise((width, height), 24).convert("RGB")
    return Image.blend(image, noise, 0.12)


def synthetic_jpeg(index: int, quality: int = 90, seed: int = 0) -> bytes:
    """The ``index``-th photo-like JPEG of a series, in the usual sizes in turn."""
    width, height = SIZES[index % len(SIZES)]
    buffer = io.BytesIO()
    synthetic_photo(width, height, seed + index).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def synthetic_jpegs(count: int, quality: int = 90, seed: int = 0) -> list[bytes]:
    """``count`` photo-like JPEGs in the usual sizes (deterministic for a seed)."""
    return [synthetic_jpeg(index, quality, seed) for index in range(count)]


@functools.cache
def _warmup_image(index: int) -> bytes:
    return synthetic_jpeg(index, seed=10_000)


# How many of them a warm-up runs: two sizes are enough to run decoding and resizing.
WARMUP_IMAGES = 2


def warmup_images(count: int = 8) -> tuple[bytes, ...]:
    """The start-up check's images (made once per process, each when first needed: making one
    takes tens of milliseconds, and a warm-up needs only a couple)."""
    return tuple(_warmup_image(index) for index in range(count))

"""Benchmark images: photo-like JPEGs made here (deterministic), or a folder of your own."""

from __future__ import annotations

import io
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

# Typical web and dataset photo sizes (ImageNet's validation images average about 500x400).
SIZES = [(500, 375), (640, 480), (375, 500), (800, 600), (500, 333), (1024, 768)]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}


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


def generate(count: int = 64, quality: int = 90, seed: int = 0) -> list[bytes]:
    images = []
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        buffer = io.BytesIO()
        synthetic_photo(width, height, seed + index).save(buffer, "JPEG", quality=quality)
        images.append(buffer.getvalue())
    return images


def load(folder: Path, limit: int | None = None) -> list[bytes]:
    """Every image file under ``folder`` (recursively), in name order."""
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise SystemExit(f"no images under {folder}")
    return [path.read_bytes() for path in paths[:limit]]


def corpus(folder: Path | None, count: int = 64) -> list[bytes]:
    return load(folder, count) if folder is not None else generate(count)


def content_type(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data[:4] == b"RIFF":
        return "image/webp"
    return "image/jpeg"

"""Benchmark images: photo-like JPEGs made here (deterministic), or a folder of your own."""

from __future__ import annotations

import io
from pathlib import Path

from app.engine import synthetic_jpegs, synthetic_photo

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}


def generate(count: int = 64, quality: int = 90, seed: int = 0) -> list[bytes]:
    """Photo-like JPEGs made here (the same generator the server warms up with)."""
    return synthetic_jpegs(count, quality, seed)


def camera(count: int = 64, size: tuple[int, int] = (640, 480), seed: int = 0) -> list[bytes]:
    """Photo-like JPEGs all of one size (``width``, ``height``), as one camera's frames."""
    frames = []
    for index in range(count):
        buffer = io.BytesIO()
        synthetic_photo(*size, seed + index).save(buffer, "JPEG", quality=90)
        frames.append(buffer.getvalue())
    return frames


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

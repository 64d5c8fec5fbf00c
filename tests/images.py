"""Images made with Pillow for tests: solid colours, photo-like noise, every mode and format."""

from __future__ import annotations

import io
import random
import struct
import zlib
from typing import Any

from PIL import Image


def photo(width: int = 320, height: int = 240, seed: int = 0) -> Image.Image:
    """A smooth random gradient with texture: distinct per seed, compresses like a photo."""
    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((width, height))
    channels = []
    for _ in range(3):
        angle = rng.uniform(0, 360)
        scale, offset = rng.uniform(0.3, 1.0), rng.uniform(0, 120)
        table = [min(255, int(value * scale + offset)) for value in range(256)]
        channels.append(base.rotate(angle, expand=False).point(table))
    image = Image.merge("RGB", channels)
    noise = Image.effect_noise((width, height), rng.uniform(10, 40)).convert("RGB")
    return Image.blend(image, noise, 0.2)


def solid(color: tuple[int, int, int], width: int = 64, height: int = 48) -> Image.Image:
    return Image.new("RGB", (width, height), color)


def encode(image: Image.Image, fmt: str = "JPEG", **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def jpeg(image: Image.Image | None = None, **options: Any) -> bytes:
    return encode(image if image is not None else photo(), "JPEG", **options)


def png(image: Image.Image | None = None, **options: Any) -> bytes:
    return encode(image if image is not None else photo(), "PNG", **options)


def webp(image: Image.Image | None = None, **options: Any) -> bytes:
    return encode(image if image is not None else photo(), "WEBP", **options)


def png_bomb(width: int = 60_000, height: int = 60_000) -> bytes:
    """A valid-looking PNG header declaring a huge image, followed by almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def corrupt_png() -> bytes:
    """A complete PNG whose image data chunk fails its CRC (the kind that crashes libpng users)."""
    data = bytearray(png(photo(48, 32, seed=9)))
    at = data.find(b"IDAT") + 20
    data[at : at + 8] = b"\x00" * 8
    return bytes(data)


def jpeg_bomb(width: int = 60_000, height: int = 60_000) -> bytes:
    """A small real JPEG whose SOF marker is rewritten to declare a huge size."""
    data = bytearray(jpeg(solid((120, 120, 120), 16, 16)))
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = data.find(marker)
        if at >= 0:
            # SOF: marker, length (2), precision (1), height (2), width (2)
            data[at + 5 : at + 7] = struct.pack(">H", height)
            data[at + 7 : at + 9] = struct.pack(">H", width)
            return bytes(data)
    raise AssertionError("no SOF marker found")


def with_exif_orientation(image: Image.Image, orientation: int, fmt: str = "JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, fmt, exif=exif.tobytes())


def blank_png(width: int, height: int) -> bytes:
    """A real, valid 8-bit grey PNG of ``width`` x ``height`` black pixels, without an eXIf
    chunk: it compresses about a thousand to one (20000 x 20000 in some 390 KB), so its size
    is all in what decoding it would make."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # a filter byte, then the row's pixels
    parts = [compressor.compress(row) for _ in range(height)]
    idat = b"".join(parts) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )

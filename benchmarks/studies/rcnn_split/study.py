"""Whether Faster R-CNN would gain from an inference runtime for the part of it with fixed shapes.

Per round, a fresh process builds torchvision's Faster R-CNN MobileNetV3 320 (random weights)
and times, on the same random batch, at batch 1 and at batch 8 (the best of ``--repeats`` runs,
milliseconds per image): the eager model, and the model in two parts, its backbone and feature
pyramid on OpenVINO (converted in the process, fp32) and its region proposals, RoI pooling and
box head in PyTorch on the feature maps OpenVINO returns (made channels_last, as the backbone
makes them in PyTorch); and as the server serves it (``BACKEND=onnxruntime`` and
``BACKEND=openvino``, random weights of the server's own loading): the backbone and, on the
proposals PyTorch makes, the RoI pooling, box head and predictors as a second graph, both on the
runtime, torch on one thread. Medians over rounds.

Usage: ``python -m benchmarks rcnn_split --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine, machine_markdown, median, publish, table

HERE = Path(__file__).resolve().parent  # the study's report and its runs
ROOT = HERE.parent.parent.parent
MODEL = "fasterrcnn_mobilenet_v3_large_320_fpn"
SIZE = 320


def measure(repeats: int) -> dict[str, float]:
    """In this process: milliseconds per image, eager and in two parts, at batch 1 and 8."""
    import openvino
    import torch
    from torchvision.models import get_model
    from torchvision.models.detection.image_list import ImageList

    model: Any = get_model(MODEL, weights=None, weights_backbone=None).eval()

    class Backbone(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model.backbone

        def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(self.body(batch).values())

    batch = torch.rand(8, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        levels = tuple(model.backbone(batch[:1]).keys())
    converted = openvino.convert_model(Backbone().eval(), example_input=batch[:1],
                                       input=[(-1, 3, SIZE, SIZE)])  # fmt: skip
    compiled = openvino.Core().compile_model(converted, "CPU", {"PERFORMANCE_HINT": "LATENCY"})
    heads_s: dict[int, float] = {}

    def two_parts(images: torch.Tensor) -> Any:
        maps = [torch.from_numpy(each).contiguous(memory_format=torch.channels_last)
                for each in compiled(images.numpy()).values()]  # fmt: skip
        features = OrderedDict(zip(levels, maps, strict=True))
        shape = maps[0].new_zeros(()).expand(len(images), 3, SIZE, SIZE)
        listed = ImageList(shape, [(SIZE, SIZE)] * len(images))
        started = time.perf_counter()
        proposals, _ = model.rpn(listed, features)
        found, _ = model.roi_heads(features, proposals, listed.image_sizes)
        spent = time.perf_counter() - started
        heads_s[len(images)] = min(heads_s.get(len(images), 1e9), spent)
        return found

    def eager(images: torch.Tensor) -> Any:
        return model(list(images))

    figures: dict[str, float] = {}
    served = {name: _served(name) for name in RUNTIMES}
    with torch.inference_mode():
        for rows in (1, 8):
            images = batch[:rows].contiguous()
            for name, run in (("eager", eager), ("two_parts", two_parts)):
                run(images)  # warm
                best = min(_timed(run, images) for _ in range(repeats))
                figures[f"{name}_ms_per_image_{rows}"] = 1000 * best / rows
            figures[f"pytorch_part_ms_per_image_{rows}"] = 1000 * heads_s[rows] / rows
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the server leaves torch beside these two graphs
            for name, backend in served.items():
                backend.forward(images)  # warm
                best = min(_timed(backend.forward, images) for _ in range(repeats))
                figures[f"served_{name}_ms_per_image_{rows}"] = 1000 * best / rows
            torch.set_num_threads(threads)
    return figures


RUNTIMES = ("onnxruntime", "openvino")


def _served(name: str) -> Any:
    """The runtime's backend as the server builds it: both graphs on the runtime."""
    import tempfile

    from app.engine import build_engine
    from app.settings import Settings

    settings = Settings(_env_file=None, model=MODEL, weights="none", backend=name,
                        precision="fp32", image_size=SIZE,
                        artifacts_dir=Path(tempfile.mkdtemp(prefix="rcnn-split-")))  # fmt: skip
    return build_engine(settings.own_model()).backend


def _timed(run: Callable[[Any], Any], images: Any) -> float:
    started = time.perf_counter()
    run(images)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: list[dict[str, float]] = []
    for round_index in range(args.rounds):
        command = [sys.executable, "-m", "benchmarks.studies.rcnn_split.study", "--one",
                   str(args.repeats)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        samples.append(figures)
        print(f"round {round_index + 1}/{args.rounds}: {figures}", flush=True)
    medians = {name: median([row[name] for row in samples]) for name in samples[0]}
    return {"machine": machine(), "rounds": args.rounds, "repeats": args.repeats,
            "medians": medians, "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    m = data["medians"]
    rows = [
        [rows, m[f"eager_ms_per_image_{rows}"], m[f"two_parts_ms_per_image_{rows}"],
         m[f"pytorch_part_ms_per_image_{rows}"],
         m[f"eager_ms_per_image_{rows}"] / m[f"two_parts_ms_per_image_{rows}"]]
        for rows in (1, 8)
    ]  # fmt: skip
    served = []
    for count in (1, 8):
        eager, runtimes = m[f"eager_ms_per_image_{count}"], []
        for name in RUNTIMES:
            runtimes.append(m.get(f"served_{name}_ms_per_image_{count}", float("nan")))
        served.append([count, eager, *runtimes, *(eager / each for each in runtimes)])
    return f"""# Faster R-CNN with its backbone on OpenVINO, and as served

`python -m benchmarks rcnn_split --rounds {data["rounds"]}`: {MODEL} (random weights) on one
random batch, best of {data["repeats"]} runs each, a fresh process per round, medians over
rounds.

Eager PyTorch against its backbone and feature pyramid on OpenVINO (fp32) with the proposals,
RoI pooling and box head in PyTorch:

{
        table(
            [
                "batch",
                "eager ms / image",
                "two parts ms / image",
                "of which PyTorch's part",
                "eager / two parts",
            ],
            rows,
        )
    }

As the server serves it: the backbone and, on PyTorch's proposals, the RoI pooling, box head
and predictors as a second graph, both on the runtime (fp32), torch on one thread:

{
        table(
            [
                "batch",
                "eager ms / image",
                "ONNX Runtime ms / image",
                "OpenVINO ms / image",
                "eager / ONNX Runtime",
                "eager / OpenVINO",
            ],
            served,
        )
    }

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    parser = command_line(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = run(args)
    publish("rcnn-split", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

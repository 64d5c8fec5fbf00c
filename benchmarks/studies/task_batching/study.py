"""What a batch saves a detector's and a segmenter's forward pass, per image, on each backend.

Per round, a fresh process per model and backend builds the engine as the server does
(random weights, the served input size), letterboxes photo-like JPEGs of mixed sizes into
normalised batches as the server does, and times the backend's forward pass (for a detector,
what PyTorch decodes of it too) at batch 1 and at batch 8: the best of ``--repeats`` runs
each, in milliseconds per image. A detector on a runtime also reports its decoding alone
(SSD's anchors, boxes, the batch's detections and suppression, in PyTorch; Faster R-CNN's
proposals and suppression in PyTorch, with its box head, the runtime's second graph).
SSDlite's INT8 on both runtimes is built from its random weights on generated photos and served
past its gate, which refuses a detector confident of no box: its speed only. Medians over
rounds.

Usage: ``python -m benchmarks task_batching --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine, machine_markdown, median, publish, table

HERE = Path(__file__).resolve().parent  # the study's report and its runs
ROOT = HERE.parent.parent.parent

CONFIGS = [
    ("ssdlite320_mobilenet_v3_large", "torch"),
    ("ssdlite320_mobilenet_v3_large", "onnxruntime"),
    ("ssdlite320_mobilenet_v3_large", "openvino"),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "torch"),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "onnxruntime"),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "openvino"),
    ("deeplabv3_mobilenet_v3_large", "torch"),
    ("deeplabv3_mobilenet_v3_large", "onnxruntime"),
    ("deeplabv3_mobilenet_v3_large", "openvino"),
    # INT8 from random weights, served ungated: its speed only (the gate refuses such a
    # detector, which is confident of no box).
    ("ssdlite320_mobilenet_v3_large", "onnxruntime int8"),
    ("ssdlite320_mobilenet_v3_large", "openvino int8"),
]


def measure(model: str, backend: str, artifacts: Path, repeats: int) -> dict[str, Any]:
    """In this process: milliseconds per image at batch 1 and 8 (best of ``repeats``)."""
    import torch

    from app.engine import build_engine, calibration_batches, load_configured_model
    from app.settings import Settings
    from benchmarks.corpus import generate

    backend, _, precision = backend.partition(" ")
    int8: dict[str, Any] = {}
    if precision == "int8":
        calibration = artifacts / "calibration"
        if not calibration.is_dir():
            calibration.mkdir()
            for index, data in enumerate(generate(20, seed=7)):
                (calibration / f"{index:02d}.jpg").write_bytes(data)
        int8 = {"precision": "int8", "calibration_dir": calibration, "allow_ungated_int8": True}
    settings = Settings(_env_file=None, model=model, weights="none", backend=backend,
                        artifacts_dir=artifacts, max_batch_size=8, grpc_port=0,
                        shards=1, **int8)  # fmt: skip
    engine = build_engine(settings.own_model())
    loaded = load_configured_model(settings.own_model())  # its own input and statistics
    photos = generate(8)
    (batch,) = [torch.from_numpy(each) for each in calibration_batches(loaded, photos, 8)]
    backend_ = engine.backend
    decode_s: dict[int, float] = {}
    decode = backend_.decode
    if decode is not None:  # a runtime's graph: time what PyTorch decodes of it apart

        def timed(outputs: Any, canvas: tuple[int, int], sizes: Any) -> Any:
            started = time.perf_counter()
            answer = decode(outputs, canvas, sizes)
            decode_s[len(outputs[0])] = min(decode_s.get(len(outputs[0]), 1e9),
                                            time.perf_counter() - started)  # fmt: skip
            return answer

        backend_.decode = timed
    figures: dict[str, Any] = {"backend": backend_.name, "precision": backend_.precision}
    with torch.inference_mode():
        for rows in (1, 8):
            inputs = batch[:rows].contiguous()
            backend_.forward(inputs)  # warm
            best = min(_timed(backend_.forward, inputs) for _ in range(repeats))
            figures[f"ms_per_image_{rows}"] = 1000 * best / rows
            if rows in decode_s:
                figures[f"decode_ms_per_image_{rows}"] = 1000 * decode_s[rows] / rows
    figures["batch_saving"] = 1 - figures["ms_per_image_8"] / figures["ms_per_image_1"]
    return figures


def _timed(forward: Any, inputs: Any) -> float:
    started = time.perf_counter()
    forward(inputs)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as artifacts:
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for model, backend in CONFIGS:
                command = [sys.executable, "-m", "benchmarks.studies.task_batching.study",
                           "--one", model, backend, artifacts, str(args.repeats)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=True,
                                      cwd=ROOT)  # fmt: skip
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                samples.setdefault(f"{model} {backend}", []).append(figures)
                print(f"  {model} {backend}: {figures['ms_per_image_1']:.1f} ms/image alone, "
                      f"{figures['ms_per_image_8']:.1f} in a batch of 8", flush=True)  # fmt: skip
    medians = {
        key: {name: median([row[name] for row in rows]) for name in rows[0]
              if isinstance(rows[0][name], float)}
        for key, rows in samples.items()
    }  # fmt: skip
    return {"machine": machine(), "rounds": args.rounds, "repeats": args.repeats,
            "medians": medians, "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for key, m in data["medians"].items():
        decode = (f"{m['decode_ms_per_image_1']:.1f} / {m['decode_ms_per_image_8']:.1f}"
                  if "decode_ms_per_image_8" in m else "in the forward pass")  # fmt: skip
        rows.append([key, m["ms_per_image_1"], m["ms_per_image_8"],
                     f"{100 * m['batch_saving']:.0f}%", decode])  # fmt: skip
    return f"""# What a batch saves per image: detectors and segmenters

`python -m benchmarks task_batching --rounds {data["rounds"]}`: each backend's forward pass
(with what PyTorch decodes of a detector's graph) on letterboxed photo-like JPEGs, best of
{data["repeats"]} runs at batch 1 and at batch 8, a fresh process per model, backend and round;
medians over rounds. Random weights. A detector's decoding on a runtime is timed apart too:
SSD's anchors, boxes and detections; Faster R-CNN's proposals, its box head (the runtime's
second graph) and suppression.

{
        table(
            [
                "model backend",
                "ms / image alone",
                "ms / image in 8",
                "saved by the batch",
                "decode ms / image, alone / in 8",
            ],
            rows,
        )
    }

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        model, backend, artifacts, repeats = sys.argv[2:6]
        print(json.dumps(measure(model, backend, Path(artifacts), int(repeats))))
        return
    parser = command_line(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = run(args)
    publish("task-batching", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""Does a batch run faster in parts side by side, each on its share of the cores, than whole?

Per round, a fresh process per model and backend builds the engine as the server does (random
weights, ``SHARDS=1``), letterboxes or crops photo-like JPEGs into normalised batches as the
server does, and times the backend's forward pass (for a detector, what PyTorch decodes of it
too) three ways, in turn: one image whole (every thread on it, the unbatched server's pass), a
batch of eight whole, and the same batch in as many parts as threads, side by side, one
thread each (``SHARDS=auto``'s candidate). The best of ``--repeats`` runs each, in
milliseconds per image; medians over rounds.

Usage: ``python -m benchmarks shards --rounds 3``
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
ROWS = 8

CONFIGS = [
    ("resnet18", "onnxruntime"),
    ("resnet18", "openvino"),
    ("resnet50", "onnxruntime"),
    ("efficientnet_lite0", "onnxruntime"),
    ("ssdlite320_mobilenet_v3_large", "torch"),
    ("ssdlite320_mobilenet_v3_large", "onnxruntime"),
    ("ssdlite320_mobilenet_v3_large", "openvino"),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "onnxruntime"),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "openvino"),
    ("deeplabv3_mobilenet_v3_large", "onnxruntime"),
    ("deeplabv3_mobilenet_v3_large", "openvino"),
]


def measure(model: str, backend: str, artifacts: Path, repeats: int) -> dict[str, Any]:
    """In this process: milliseconds per image alone, in a batch whole and in a batch in
    parts (best of ``repeats``, the three taken in turn)."""
    import torch

    from app.engine import (
        build_engine,
        calibration_batches,
        load_configured_model,
        sharded_backend,
    )
    from app.settings import Settings
    from benchmarks.corpus import generate

    settings = Settings(_env_file=None, model=model, weights="none", backend=backend,
                        artifacts_dir=artifacts, max_batch_size=ROWS, grpc_port=0,
                        shards=1)  # fmt: skip
    config = settings.own_model()
    engine = build_engine(config)
    loaded = load_configured_model(config)
    (batch,) = [torch.from_numpy(each) for each in calibration_batches(loaded, generate(ROWS),
                                                                       ROWS)]  # fmt: skip
    whole = engine.backend
    parts = config.threads
    split = sharded_backend(whole, parts, config.threads // parts)
    ways = {"alone": (whole, batch[:1].contiguous()), "whole": (whole, batch),
            "parts": (split, batch)}  # fmt: skip
    best: dict[str, float] = {}
    # torch's threads in the batch's own thread, as the engine sets them beside a runtime.
    torch.set_num_threads(engine.torch_threads or config.threads)
    with torch.inference_mode():
        for backend_, inputs in ways.values():
            backend_.forward(inputs)  # warm
        for _ in range(repeats):
            for name, (backend_, inputs) in ways.items():
                started = time.perf_counter()
                backend_.forward(inputs)
                seconds = (time.perf_counter() - started) / len(inputs)
                best[name] = min(best.get(name, 1e9), seconds)
    return {
        "backend": whole.name,
        "precision": whole.precision,
        "parts": parts,
        **{f"ms_per_image_{name}": 1000 * seconds for name, seconds in best.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as artifacts:
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for model, backend in CONFIGS:
                command = [sys.executable, "-m", "benchmarks.studies.shards.study", "--one",
                           model, backend, artifacts, str(args.repeats)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=True,
                                      cwd=ROOT)  # fmt: skip
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                samples.setdefault(f"{model} {backend}", []).append(figures)
                print(f"  {model} {backend}: {figures['ms_per_image_alone']:.1f} ms/image "
                      f"alone, {figures['ms_per_image_whole']:.1f} in a batch whole, "
                      f"{figures['ms_per_image_parts']:.1f} in parts", flush=True)  # fmt: skip
    medians = {
        key: {name: median([row[name] for row in rows]) for name in rows[0]
              if isinstance(rows[0][name], float)}
        for key, rows in samples.items()
    }  # fmt: skip
    return {"machine": machine(), "rounds": args.rounds, "repeats": args.repeats, "rows": ROWS,
            "medians": medians, "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for key, m in data["medians"].items():
        rows.append([key, m["ms_per_image_alone"], m["ms_per_image_whole"],
                     m["ms_per_image_parts"],
                     f"{m['ms_per_image_whole'] / m['ms_per_image_parts']:.2f}x",
                     f"{m['ms_per_image_alone'] / m['ms_per_image_parts']:.2f}x"])  # fmt: skip
    return f"""# A batch in parts side by side against whole

`python -m benchmarks shards --rounds {data["rounds"]}`: each backend's forward pass (with
what PyTorch decodes of a detector's graph) on letterboxed (or cropped) photo-like JPEGs, best
of {data["repeats"]} runs one image alone, a batch of {data["rows"]} whole and the same batch
in parts side by side (as many as threads, one thread each), taken in turn; a fresh process
per model, backend and round; medians over rounds. Random weights.

{
        table(
            [
                "model backend",
                "ms / image alone",
                "ms / image, batch whole",
                "ms / image, batch in parts",
                "parts against whole",
                "parts against alone",
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
    publish("shards", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""torch's threads beside a runtime: as served, against torch on every CPU in every thread.

With ONNX Runtime or OpenVINO doing the forward pass, torch still normalises each batch and
takes its top classes (the batcher's threads), and resizes each image (the decode threads).
Served, those steps run on one torch thread (the decode threads take over the count the
batches set); the other way is torch's default, its OpenMP team on every CPU the process may
use. Per configuration and way, in a fresh process each round:

- **forward**: the runtime on a ready batch;
- **batches**: ``run_batch`` on prepared images (collate, forward, top classes), no decoding;
- **pipelined**: the next batch decoded while this one runs (``benchmarks.offline``'s limit).

Usage: ``python -m benchmarks torch_threads --model resnet18``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from app.cpus import available_cpus
from app.engine import ImageRequest
from benchmarks.backends import prepare_artifacts, set_arguments
from benchmarks.common import command_line, machine, machine_markdown, median, publish, table
from benchmarks.compare import server_env, variants
from benchmarks.corpus import generate
from benchmarks.offline import _rate, forward_only, make_engine, pipelined

HERE = Path(__file__).resolve().parent  # the study's report and its runs

DEFAULT_CONFIGS = [
    "openvino int8:backend=openvino,precision=int8",
    "onnxruntime int8:backend=onnxruntime,precision=int8",
    "openvino fp32:backend=openvino,precision=fp32",
    "onnxruntime fp32:backend=onnxruntime,precision=fp32",
]
WAYS = ("served", "every cpu")


def child(
    model: str, precision: str, batch_size: int, seconds: float, way: str, extra: dict[str, Any]
) -> None:
    engine = make_engine(model, precision, batch_size, **extra)
    cpus = available_cpus()  # the server's decode threads and torch's default team
    # Served, the decode threads start after a batch (the warm-up) has set torch's count to
    # the engine's, and take it over; the other way, they start with every CPU.
    if way != "served":
        engine.torch_threads = cpus
        torch.set_num_threads(cpus)
    pool = ThreadPoolExecutor(cpus)
    images = generate(64)
    prepared = [engine.prepare(data) for data in images[:batch_size]]

    def batches() -> int:
        engine.run_batch([ImageRequest(image, 5) for image in prepared])
        return batch_size

    print(json.dumps({
        "forward": forward_only(engine, batch_size, seconds),
        "batches": _rate(batches, seconds),
        "pipelined": pipelined(engine, images, batch_size, seconds, pool),
    }))  # fmt: skip


def run_child(
    model: str, batch_size: int, seconds: float, way: str, settings: dict[str, str]
) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.studies.torch_threads.study",
               "--child", way, "--model", model,
               "--precision", settings.get("BATCHSERVE_PRECISION", "fp32"),
               "--batch-size", str(batch_size), "--seconds", str(seconds),
               *set_arguments(settings)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmarks torch_threads failed:\n{result.stderr[-3000:]}")
    rates: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = variants(args.configs)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {way: [] for way in WAYS} for name in configs
    }
    with tempfile.TemporaryDirectory() as scratch:
        calibration = Path(scratch) / "calibration"
        calibration.mkdir()
        for index, data in enumerate(generate(32, seed=500)):
            (calibration / f"{index}.jpg").write_bytes(data)
        shared = {
            **server_env(args.model, "fp32", args.batch_size),
            "BATCHSERVE_ARTIFACTS_DIR": str(Path(scratch) / "artifacts"),
            "BATCHSERVE_CALIBRATION_DIR": str(calibration),
            "BATCHSERVE_ALLOW_UNGATED_INT8": "true",  # speed only: the gate is not the point
        }
        settings = {name: {**shared, **values} for name, values in configs.items()}
        prepare_artifacts(args.model, args.batch_size, settings)
        for round_index in range(args.rounds):
            for name, values in settings.items():
                ways = WAYS if round_index % 2 == 0 else WAYS[::-1]
                for way in ways:
                    rates = run_child(args.model, args.batch_size, args.seconds, way, values)
                    samples[name][way].append(rates)
                    print(
                        f"round {round_index + 1} {name}, {way}: "
                        + ", ".join(f"{key} {value:.1f}" for key, value in rates.items()),
                        flush=True,
                    )
    medians = {
        name: {way: {key: median([s[key] for s in runs]) for key in runs[0]}
               for way, runs in by_way.items()}
        for name, by_way in samples.items()
    }  # fmt: skip
    return {"machine": machine(), "model": args.model, "batch_size": args.batch_size,
            "rounds": args.rounds, "seconds": args.seconds, "configs": args.configs,
            "medians": medians, "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for name, by_way in data["medians"].items():
        served, every = by_way["served"], by_way["every cpu"]
        for way, rates in by_way.items():
            rows.append([name, way, rates["forward"], rates["batches"], rates["pipelined"],
                         rates["batches"] / rates["forward"],
                         rates["pipelined"] / rates["forward"]])  # fmt: skip
        rows.append([name, "served / every cpu", "", served["batches"] / every["batches"],
                     served["pipelined"] / every["pipelined"], "", ""])  # fmt: skip
    body = table(
        [
            "configuration",
            "torch threads",
            "forward img/s",
            "batches img/s",
            "pipelined img/s",
            "batches / forward",
            "pipelined / forward",
        ],
        rows,
    )
    return f"""# torch's threads beside a runtime: {data["model"]}, batch {data["batch_size"]}

`python -m benchmarks torch_threads`: medians of {data["rounds"]} rounds, a fresh process per
configuration, way and round, {data["seconds"]} s per figure. "served": torch on one thread in
the batches and the decode threads; "every cpu": torch's default OpenMP team in both.

{body}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--name", default=None, help="results/<name>.md (default from the model)")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--set", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        extra: dict[str, Any] = dict(item.split("=", 1) for item in args.set)
        child(args.model, args.precision, args.batch_size, args.seconds, args.child, extra)
        return
    data = run(args)
    publish(args.name or f"torch-threads-{args.model}", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

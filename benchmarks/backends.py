"""Backends side by side, in one run: PyTorch (eager, TorchScript), ONNX Runtime, OpenVINO, and
their INT8 builds, on the same model, machine and images.

Per configuration and round, with fresh processes: the offline limits (``benchmarks.offline``:
the forward pass alone, and the pipelined limit with decoding), then a server driven by wrk at
64 clients and at one. Rounds interleave the configurations, so the machine's drift over
minutes shifts them alike; the report gives medians over rounds, and served/limit and each
configuration's served images/s against the first one's as the median of the ratios within
each round.

INT8 artefacts are built before the first round by ``python -m app.quantize`` with the plain
recipe of this CPU's INT8 class (calibrated on ``--calibration``, or on generated images). A
model with random weights cannot pass a meaningful accuracy gate, so for throughput they are
served with ``ALLOW_UNGATED_INT8=true``, and the report says so; the accuracy of INT8 is judged
on a real model (``python -m benchmarks.int8_gate``).

Usage: ``python -m benchmarks.backends --model resnet50 --rounds 2``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.engine import plain_recipe, this_cpu
from benchmarks import wrk
from benchmarks.common import (
    command_line,
    load_arguments,
    machine,
    machine_markdown,
    median,
    publish,
    table,
)
from benchmarks.compare import server_env, variants
from benchmarks.corpus import corpus, generate
from harness.servers import UvicornProcess

DEFAULT_CONFIGS = [
    "torch eager:compile=none",
    "torch torchscript:compile=torchscript",
    "onnxruntime:backend=onnxruntime",
    "openvino:backend=openvino",
    "onnxruntime int8:backend=onnxruntime,precision=int8",
    "openvino int8:backend=openvino,precision=int8",
]


# Settings that benchmarks.offline takes as its own arguments.
_OWN = {"MODEL", "PRECISION", "MAX_BATCH_SIZE", "WEIGHTS", "LOG_LEVEL"}


def engine_settings(settings: dict[str, str]) -> dict[str, str]:
    """``BATCHSERVE_*`` settings as ``make_engine`` takes them (``name: value``), less the model,
    precision, batch size, weights and log level, which are arguments of their own."""
    return {key.removeprefix("BATCHSERVE_").lower(): value for key, value in settings.items()
            if key.removeprefix("BATCHSERVE_") not in _OWN}  # fmt: skip


def set_arguments(settings: dict[str, str]) -> list[str]:
    """``--set name=value ...`` for the settings an offline measurement takes that way."""
    return ["--set", *(f"{key}={value}" for key, value in engine_settings(settings).items())]


def offline(
    model: str, batch_size: int, seconds: float, settings: dict[str, str]
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.offline", "--model", model,
        "--precision", settings.get("BATCHSERVE_PRECISION", "fp32"),
        "--batch-sizes", str(batch_size), "--seconds", str(seconds), "--runs", "1", "--json",
        *set_arguments(settings),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmarks.offline failed:\n{result.stderr[-3000:]}")
    output = result.stdout
    (row,) = json.loads(output.strip().splitlines()[-1])
    return {"forward": row["forward"], "pipelined": row["pipelined"]}


def prepare_artifacts(model: str, batch_size: int, configs: dict[str, dict[str, str]]) -> None:
    """Export and quantize once, so that every round starts from finished artefacts."""
    for name, settings in configs.items():
        backend = settings.get("BATCHSERVE_BACKEND", "torch")
        if backend == "torch":
            continue
        print(f"preparing {name}", flush=True)
        if settings.get("BATCHSERVE_PRECISION") == "int8":
            recipe = plain_recipe(backend, this_cpu())
            quantized = subprocess.run(
                [sys.executable, "-m", "app.quantize", "--recipe", recipe, "--calibration",
                 settings["BATCHSERVE_CALIBRATION_DIR"]],
                env={**os.environ, **settings, "BATCHSERVE_MODEL": model},
                capture_output=True, text=True,
            )  # fmt: skip
            if quantized.returncode not in (0, 1):  # 1: built, and its gate failed
                raise RuntimeError(f"app.quantize failed:\n{quantized.stderr[-3000:]}")
        offline(model, batch_size, 0.2, settings)


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    stack = ExitStack()
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    calibration = args.calibration
    if calibration is None:
        calibration = scratch / "calibration"
        calibration.mkdir()
        for index, data in enumerate(generate(32, seed=500)):
            (calibration / f"{index}.jpg").write_bytes(data)
    shared = {
        **server_env(args.model, "fp32", args.batch_size),
        "BATCHSERVE_ARTIFACTS_DIR": str(args.artifacts or scratch / "artifacts"),
        "BATCHSERVE_CALIBRATION_DIR": str(calibration),
        "BATCHSERVE_ALLOW_UNGATED_INT8": "true" if args.ungated_int8 else "false",
    }
    configs = {name: {**shared, **settings} for name, settings in variants(args.configs).items()}
    with stack:
        prepare_artifacts(args.model, args.batch_size, configs)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for name, settings in configs.items():
                sample = offline(args.model, args.batch_size, args.seconds, settings)
                with UvicornProcess(settings) as server:
                    many = wrk.run(server.url, images, args.clients, args.warmup, args.seconds)
                    one = wrk.run(server.url, images, 1, args.warmup, args.seconds)
                sample |= {"served": many["throughput"], "p99_ms": many["latency_ms"]["p99"],
                           "one_client_p50_ms": one["latency_ms"]["p50"],
                           "mean_batch": many["server"]["mean_batch_size"]}  # fmt: skip
                samples[name].append(sample)
                print(f"  {name}: forward {sample['forward']:.1f}, pipelined "
                      f"{sample['pipelined']:.1f}, served {sample['served']:.1f} images/s",
                      flush=True)  # fmt: skip
    medians = {
        name: {key: median([sample[key] for sample in rows]) for key in rows[0]}
        for name, rows in samples.items()
    }
    first = next(iter(samples))
    for name, row in medians.items():
        # Each ratio within a round (measured minutes apart at most), then the median over
        # rounds: a machine whose speed drifts over the run moves both sides of a ratio alike.
        row["served_vs_limit"] = median(
            [sample["served"] / sample["pipelined"] for sample in samples[name]]
        )
        row["served_vs_first"] = median([
            mine["served"] / theirs["served"]
            for mine, theirs in zip(samples[name], samples[first], strict=True)
        ])  # fmt: skip
    return {"machine": machine(), "model": args.model, "batch_size": args.batch_size,
            "clients": args.clients, "rounds": args.rounds, "seconds": args.seconds,
            "configs": args.configs, "ungated_int8": args.ungated_int8, "medians": medians,
            "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    first = next(iter(data["medians"]))
    rows = [
        [name, m["forward"], m["pipelined"], m["served"], m["served_vs_limit"],
         m["served_vs_first"], m["p99_ms"], m["one_client_p50_ms"]]
        for name, m in data["medians"].items()
    ]  # fmt: skip
    heads = ["configuration", "forward img/s", "pipelined limit img/s",
             f"served @{data['clients']} img/s", "served / limit", f"served / {first}",
             f"p99 ms @{data['clients']}", "p50 ms @1"]  # fmt: skip
    settings = "\n".join(f"- {spec}" for spec in data["configs"])
    per_round = table(
        ["configuration", *(f"round {index + 1}" for index in range(data["rounds"]))],
        [[name, *(f"{r['forward']:.1f}; {r['pipelined']:.1f}; {r['served']:.1f}" for r in rows)]
         for name, rows in data["samples"].items()],
    )  # fmt: skip
    note = (
        "INT8 models built here from random weights cannot pass a meaningful accuracy gate: "
        "they were served with `ALLOW_UNGATED_INT8=true` for these throughput figures only."
        if data["ungated_int8"] else "INT8 models served only with a passing gate report."
    )  # fmt: skip
    return f"""# Backends side by side: {data["model"]}, batch {data["batch_size"]}

CPU INT8 class: **{data["machine"].get("int8_class")}**.
`python -m benchmarks.backends --model {data["model"]}`: medians of {data["rounds"]} rounds
of {data["seconds"]} s per measure, fresh processes every round; wrk closed loop on the same
machine. {note}

Configurations (name: settings; fp32 unless said):

{settings}

{table(heads, rows)}

Served / limit are medians of each round's own ratio. Per round (forward; pipelined limit;
served @{data["clients"]}, images/s):

{per_round}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    load_arguments(parser, rounds=2, duration=8.0, duration_flag="--seconds")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--calibration", type=Path, help="images for INT8 calibration")
    parser.add_argument("--artifacts", type=Path, help="keep artefacts here between runs")
    parser.add_argument("--ungated-int8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--name", help="results/<name>.* (default: backends-<model>)")
    args = parser.parse_args()
    wrk.require()
    data = run(args)
    publish(args.name or f"backends-{args.model}", data, markdown(data))


if __name__ == "__main__":
    main()

"""Two busy models in one server against one: what sharing the device costs.

A repository of one model (``a``) and one of two (``a`` and ``b``, the same architecture, each
its own engine and batcher) are served in turn, fresh processes every round. The single model
gets ``--clients`` clients; the two models half of them each, at the same time (two wrk
processes). Both models run their forward passes on the same CPU one at a time (one lock per
device), so the pair should serve about what one model serves, split between them, with
batches about half as full.

Usage: ``python -m benchmarks models --model resnet18 --rounds 2``
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
from benchmarks.corpus import corpus
from harness.servers import UvicornProcess

HERE = Path(__file__).resolve().parent  # the study's report and its runs


def repository(root: Path, names: list[str], model: str, batch_size: int) -> Path:
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(
            f'model = "{model}"\nweights = "none"\nprecision = "fp32"\n'
            f"max_batch_size = {batch_size}\n"
        )
    return root


def serve_and_load(
    root: Path, names: list[str], images: list[bytes], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    env = {"BATCHSERVE_MODEL_REPOSITORY": str(root), "BATCHSERVE_LOG_LEVEL": "warning"}
    clients = args.clients // len(names)
    with UvicornProcess(env) as server, ThreadPoolExecutor(len(names)) as pool:
        runs = {
            name: pool.submit(
                wrk.run,
                server.url,
                images,
                clients,
                args.warmup,
                args.seconds,
                target=f"/predict?model={name}",
            )
            for name in names
        }
        return {name: run.result() for name, run in runs.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    layouts = {"one model": ["a"], "two models": ["a", "b"]}
    samples: dict[str, list[dict[str, Any]]] = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory() as folder:
        roots = {layout: repository(Path(folder) / layout.replace(" ", "-"), names, args.model,
                                    args.batch_size)
                 for layout, names in layouts.items()}  # fmt: skip
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for layout, names in layouts.items():
                results = serve_and_load(roots[layout], names, images, args)
                sample = {
                    "served": sum(r["throughput"] for r in results.values()),
                    "per_model": {name: r["throughput"] for name, r in results.items()},
                    "p50_ms": {name: r["latency_ms"]["p50"] for name, r in results.items()},
                    "p99_ms": {name: r["latency_ms"]["p99"] for name, r in results.items()},
                    "mean_batch": {
                        name: r["server"]["mean_batch_size"] for name, r in results.items()
                    },
                    "errors": {name: r["errors"] for name, r in results.items()},
                }
                samples[layout].append(sample)
                print(f"  {layout}: {sample['served']:.1f} images/s {sample['per_model']}",
                      flush=True)  # fmt: skip
    medians: dict[str, dict[str, Any]] = {}
    for layout, rows in samples.items():
        names = layouts[layout]
        medians[layout] = {
            "served": median([row["served"] for row in rows]),
            **{f"{key} {name}": median([row[key][name] for row in rows])
               for key in ("per_model", "p50_ms", "p99_ms", "mean_batch") for name in names},
        }  # fmt: skip
    ratio = medians["two models"]["served"] / medians["one model"]["served"]
    return {"machine": machine(), "model": args.model, "clients": args.clients,
            "batch_size": args.batch_size, "rounds": args.rounds, "seconds": args.seconds,
            "medians": medians, "two_over_one": ratio, "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for layout, m in data["medians"].items():
        names = ["a"] if layout == "one model" else ["a", "b"]
        for name in names:
            rows.append([layout, name, m[f"per_model {name}"], m[f"p50_ms {name}"],
                         m[f"p99_ms {name}"], m[f"mean_batch {name}"]])  # fmt: skip
        rows.append([layout, "together", m["served"], "", "", ""])
    return f"""# Two busy models against one: {data["model"]}

`python -m benchmarks models --model {data["model"]}`: {data["clients"]} wrk clients on one
model, or {data["clients"] // 2} on each of two (same architecture, each its own engine and
batcher, batches up to {data["batch_size"]}); medians of {data["rounds"]} rounds of
{data["seconds"]} s, fresh processes every round. Forward passes of the two models on one CPU
run one at a time.

{table(["layout", "model", "served img/s", "p50 ms", "p99 ms", "mean batch"], rows)}

Two models together serve **{data["two_over_one"]:.2f}x** what one model serves alone.

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=8)
    load_arguments(parser, rounds=2, duration_flag="--seconds")
    parser.add_argument("--name", help="results/<name>.* (default: models-<model>)")
    args = parser.parse_args()
    data = run(args)
    publish(args.name or f"models-{args.model}", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

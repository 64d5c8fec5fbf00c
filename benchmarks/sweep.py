"""What batching buys, and which window and batch size meet a latency target.

Starts the real server (a uvicorn process) once per configuration: batching off
(``MAX_BATCH_SIZE=1``) and a grid of ``MAX_QUEUE_DELAY_MS`` x ``MAX_BATCH_SIZE``; drives each
with open-loop Poisson load at several offered rates (latency from the scheduled send time);
writes a markdown table, a JSON file and PNG plots (latency vs throughput, batch sizes).

Usage::

    python -m benchmarks.sweep --model resnet18 --rates 20 40 60 80 --delays 2 10 --batch-sizes 8 16
    python -m benchmarks.sweep --answer results/sweep-resnet18.json --slo-ms 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, machine, machine_markdown, table, write_results
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from benchmarks.loadgen import LoadSpec, run_url
from benchmarks.servers import UvicornProcess


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    grid = [{"name": "batching off", "max_batch_size": 1, "max_queue_delay_ms": 0.0}]
    for size in args.batch_sizes:
        for delay in args.delays:
            grid.append({"name": f"batch {size}, window {delay:g} ms", "max_batch_size": size,
                         "max_queue_delay_ms": delay})  # fmt: skip
    return grid


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    rows = []
    for config in configurations(args):
        env = server_env(
            args.model, args.precision, config["max_batch_size"],
            BATCHSERVE_MAX_QUEUE_DELAY_MS=str(config["max_queue_delay_ms"]),
        )  # fmt: skip
        with UvicornProcess(env) as server:
            for rate in args.rates:
                spec = LoadSpec(concurrency=None, rate=rate, warmup_s=args.warmup,
                                duration_s=args.duration, timeout_s=args.timeout)  # fmt: skip
                result = asyncio.run(run_url(server.url, images, spec))
                row = {**config, "offered_rate": rate, **result}
                rows.append(row)
                print(f"  {config['name']} @ {rate:g}/s: {result['throughput']:.1f} images/s, "
                      f"p99 {result['latency_ms']['p99']:.0f} ms, mean batch "
                      f"{result['server']['mean_batch_size']:.1f}", flush=True)  # fmt: skip
    return {
        "machine": machine(),
        "model": args.model,
        "precision": args.precision,
        "duration_s": args.duration,
        "rows": rows,
    }


def best_for(rows: list[dict[str, Any]], slo_ms: float) -> dict[str, Any] | None:
    """The configuration with the highest throughput whose p99 met the SLO with no errors."""
    meeting = [
        row for row in rows
        if row["latency_ms"]["p99"] <= slo_ms and not row["errors"] and row["ok"] > 0
    ]  # fmt: skip
    return max(meeting, key=lambda row: row["throughput"]) if meeting else None


def plot(data: dict[str, Any], stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        by_config.setdefault(row["name"], []).append(row)

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name, rows in by_config.items():
        rows = sorted(rows, key=lambda row: row["offered_rate"])
        xs = [row["throughput"] for row in rows]
        style = {"linewidth": 3, "color": "black"} if name == "batching off" else {}
        axes[0].plot(xs, [row["latency_ms"]["p50"] for row in rows], marker="o", label=name,
                     **style)  # fmt: skip
        axes[1].plot(xs, [row["latency_ms"]["p99"] for row in rows], marker="o", label=name,
                     **style)  # fmt: skip
    for axis, title in zip(axes, ("p50 latency", "p99 latency"), strict=True):
        axis.set_xlabel("achieved images/s")
        axis.set_ylabel("ms (log)")
        axis.set_yscale("log")
        axis.set_title(f"{data['model']} {data['precision']}: {title} vs throughput")
        axis.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    latency_path = RESULTS / f"{stem}-latency.png"
    figure.tight_layout()
    figure.savefig(latency_path, dpi=110)
    plt.close(figure)

    top_rate = max(row["offered_rate"] for row in data["rows"])
    figure, axis = plt.subplots(figsize=(8, 4.5))
    names = [name for name in by_config if name != "batching off"]
    width = 0.8 / max(1, len(names))
    buckets = sorted({float(bound) for row in data["rows"]
                      for bound in row["server"]["batch_size_histogram"]})  # fmt: skip
    for index, name in enumerate(names):
        row = next(r for r in by_config[name] if r["offered_rate"] == top_rate)
        histogram = row["server"]["batch_size_histogram"]
        total = sum(histogram.values()) or 1
        shares = [histogram.get(f"{bound:g}", 0) / total for bound in buckets]
        axis.bar([i + index * width for i in range(len(buckets))], shares, width, label=name)
    axis.set_xticks([i + 0.4 for i in range(len(buckets))], [f"≤{b:g}" for b in buckets])
    axis.set_xlabel("requests per batch")
    axis.set_ylabel("share of batches")
    axis.set_title(f"batch sizes at {top_rate:g} images/s offered")
    axis.legend(fontsize=7)
    sizes_path = RESULTS / f"{stem}-batch-sizes.png"
    figure.tight_layout()
    figure.savefig(sizes_path, dpi=110)
    plt.close(figure)
    return [latency_path, sizes_path]


def markdown(data: dict[str, Any], slos: list[float], stem: str) -> str:
    rows = [[row["name"], row["offered_rate"], row["throughput"], row["latency_ms"]["p50"],
             row["latency_ms"]["p99"], row["server"]["mean_batch_size"],
             row["server"]["mean_queue_wait_ms"], row["server"]["device_busy_ratio"],
             json.dumps(row["errors"]) if row["errors"] else "-"]
            for row in data["rows"]]  # fmt: skip
    answers = []
    for slo in slos:
        best = best_for(data["rows"], slo)
        answers.append([f"p99 ≤ {slo:g} ms", best["name"] if best else "none met it",
                        f"{best['throughput']:.1f}" if best else "-"])  # fmt: skip
    head = ["configuration", "offered/s", "images/s", "p50 ms", "p99 ms", "mean batch",
            "queue wait ms", "device busy", "errors"]  # fmt: skip
    return f"""# Batching sweep: {data["model"]} {data["precision"]}

Open-loop Poisson load, latency from the scheduled send time; {data["duration_s"]} s per point
(`python -m benchmarks.sweep`).

{table(head, rows)}

## Best configuration for a p99 target

{table(["target", "best configuration", "images/s"], answers)}

![latency vs throughput]({stem}-latency.png)

![batch sizes]({stem}-batch-sizes.png)

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--rates", nargs="+", type=float, default=[20, 40, 60, 80])
    parser.add_argument("--delays", nargs="+", type=float, default=[2, 10, 50])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--images", type=Path)
    parser.add_argument("--slo-ms", nargs="+", type=float, default=[100, 250, 1000])
    parser.add_argument("--answer", type=Path, help="only answer --slo-ms from a sweep's JSON")
    parser.add_argument("--name", help="results/<name>.* (default: sweep-<model>)")
    args = parser.parse_args()
    if args.answer:
        rows = json.loads(args.answer.read_text())["rows"]
        for slo in args.slo_ms:
            best = best_for(rows, slo)
            print(f"p99 <= {slo:g} ms: " + (
                f"{best['name']} ({best['throughput']:.1f} images/s at {best['offered_rate']:g}/s "
                f"offered, p99 {best['latency_ms']['p99']:.0f} ms)" if best else "no configuration"
            ))  # fmt: skip
        return
    stem = args.name or f"sweep-{args.model}"
    data = run(args)
    plot(data, stem)
    text = markdown(data, args.slo_ms, stem)
    print(text)
    write_results(stem, data, text)


if __name__ == "__main__":
    main()

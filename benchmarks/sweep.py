"""What batching buys, and which batching settings meet a latency target.

Starts the real server (a uvicorn process, fresh for every configuration in every round) for
each named configuration and drives it with open-loop Poisson load at several offered rates
(latency from the scheduled send time). The default configurations cover what changes the
outcome on a CPU: batching off, the cap (``MAX_BATCH_SIZE``), a second batch in flight
(``MAX_INFLIGHT_BATCHES=2``, where the window acts while a batch runs), and the window with
idle dispatch off (``DISPATCH_WHEN_IDLE=false``, where every batch waits for it). With the CPU
defaults (one batch in flight, idle dispatch on) the window never acts: see docs/batching.md.

Writes a markdown table (medians over rounds), a JSON file and PNG plots.

Usage::

    python -m benchmarks.sweep --model resnet18 --rates 20 40 60 --rounds 2
    python -m benchmarks.sweep --configs "off:max_batch_size=1" "b8:max_batch_size=8"
    python -m benchmarks.sweep --answer results/sweep-resnet18.json --slo-ms 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    command_line,
    machine,
    machine_markdown,
    median,
    table,
    write_results,
)
from benchmarks.compare import server_env, variants
from benchmarks.corpus import corpus
from benchmarks.loadgen import LoadSpec, run_url
from harness.servers import UvicornProcess

DEFAULT_CONFIGS = [
    "batching off:max_batch_size=1",
    "batch 32 (defaults):max_batch_size=32",
    "batch 8:max_batch_size=8",
    "batch 8, 2 in flight, window 2 ms:max_batch_size=8,max_inflight_batches=2",
    "batch 8, 2 in flight, window 20 ms:max_batch_size=8,max_inflight_batches=2,"
    "max_queue_delay_ms=20",
    "batch 8, idle dispatch off, window 2 ms:max_batch_size=8,dispatch_when_idle=false",
    "batch 8, idle dispatch off, window 20 ms:max_batch_size=8,dispatch_when_idle=false,"
    "max_queue_delay_ms=20",
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    configs = variants(args.configs)
    samples: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        for name, settings in configs.items():
            env = {**server_env(args.model, args.precision, 32), **settings}
            with UvicornProcess(env) as server:
                for rate in args.rates:
                    spec = LoadSpec(concurrency=None, rate=rate, warmup_s=args.warmup,
                                    duration_s=args.duration, timeout_s=args.timeout)  # fmt: skip
                    result = asyncio.run(run_url(server.url, images, spec))
                    samples.setdefault((name, rate), []).append(result)
                    print(f"  {name} @ {rate:g}/s: {result['throughput']:.1f} images/s, "
                          f"p99 {result['latency_ms']['p99']:.0f} ms, mean batch "
                          f"{result['server']['mean_batch_size']:.1f}", flush=True)  # fmt: skip
    rows = [summarize(name, rate, results, configs[name])
            for (name, rate), results in samples.items()]  # fmt: skip
    return {
        "machine": machine(),
        "model": args.model,
        "precision": args.precision,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "configs": args.configs,
        "rows": rows,
        "samples": [
            {"name": name, "offered_rate": rate, "results": results}
            for (name, rate), results in samples.items()
        ],
    }


def summarize(
    name: str, rate: float, results: list[dict[str, Any]], settings: dict[str, str]
) -> dict[str, Any]:
    """Medians over rounds of one configuration at one offered rate."""

    def server(key: str) -> float:
        return median([result["server"][key] for result in results])

    errors: dict[str, int] = {}
    for result in results:
        for kind, count in result["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    last = results[-1]
    return {
        "name": name,
        "settings": settings,
        "offered_rate": rate,
        "throughput": median([result["throughput"] for result in results]),
        "latency_ms": {
            q: median([result["latency_ms"][q] for result in results])
            for q in ("p50", "p90", "p99")
        },
        "ok": sum(result["ok"] for result in results),
        "errors": errors,
        "server": {
            "mean_batch_size": server("mean_batch_size"),
            "mean_queue_wait_ms": server("mean_queue_wait_ms"),
            "device_busy_ratio": server("device_busy_ratio"),
            "batch_size_histogram": last["server"]["batch_size_histogram"],
        },
    }


def best_for(rows: list[dict[str, Any]], slo_ms: float) -> dict[str, Any] | None:
    """The configuration with the highest throughput whose p99 met the SLO with no errors.

    Throughputs within 2% of the best count as equal (below saturation every configuration
    serves what is offered), and among those the lowest p99 wins.
    """
    meeting = [
        row for row in rows
        if row["latency_ms"]["p99"] <= slo_ms and not row["errors"] and row["ok"] > 0
    ]  # fmt: skip
    if not meeting:
        return None
    top = max(row["throughput"] for row in meeting)
    close = [row for row in meeting if row["throughput"] >= 0.98 * top]
    return min(close, key=lambda row: row["latency_ms"]["p99"])


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
        style: dict[str, Any] = {"linewidth": 3, "color": "black"} if name == "batching off" else {}
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
    settings = "\n".join(f"- {spec}" for spec in data["configs"])
    return f"""# Batching sweep: {data["model"]} {data["precision"]}

Open-loop Poisson load, latency from the scheduled send time; {data["duration_s"]} s per point,
medians of {data["rounds"]} rounds, a fresh server process per configuration and round
(`python -m benchmarks.sweep`). Configurations (name: settings; the rest are defaults):

{settings}

{table(head, rows)}

## Best configuration for a p99 target

{table(["target", "best configuration", "images/s"], answers)}

![latency vs throughput]({stem}-latency.png)

![batch sizes]({stem}-batch-sizes.png)

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rates", nargs="+", type=float, default=[20, 40, 55, 70])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        help="name:setting=value,... (one server per configuration)",
    )
    parser.add_argument("--rounds", type=int, default=2)
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
    text = markdown(data, args.slo_ms, stem)
    write_results(stem, data, text)  # before plotting: a plotting failure loses no measurement
    plot(data, stem)
    print(text)


if __name__ == "__main__":
    main()

"""Side by side, in one run: the offline limit, batchserve, batchserve unbatched, and the naive
hand-written FastAPI endpoint, at many clients and at one.

Rounds are interleaved (every configuration once per round) and the report gives medians, so
a machine that drifts over minutes shifts all columns alike and the ratios stay honest.

- offline: the pipelined limit of ``benchmarks.offline`` (no HTTP) at the server's batch size;
- batched: ``app.main:app`` with the given ``MAX_BATCH_SIZE``;
- unbatched: the same server with ``MAX_BATCH_SIZE=1``;
- naive: ``benchmarks.naive_app`` (decode + forward per request in a thread pool).

Usage: ``python -m benchmarks.compare --model resnet18 --batch-size 16 --rounds 3``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from contextlib import ExitStack
from typing import Any

from benchmarks import wrk
from benchmarks.common import (
    load_arguments,
    machine,
    machine_markdown,
    median,
    model_arguments,
    publish,
    table,
)
from benchmarks.corpus import corpus
from benchmarks.loadgen import LoadSpec, run_url
from harness.servers import UvicornProcess


def server_env(model: str, precision: str, batch_size: int, **extra: str) -> dict[str, str]:
    return {
        "BATCHSERVE_MODEL": model,
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_PRECISION": precision,
        "BATCHSERVE_MAX_BATCH_SIZE": str(batch_size),
        "BATCHSERVE_LOG_LEVEL": "warning",
        **extra,
    }


def variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``name:setting=value,setting=value`` -> {name: {BATCHSERVE_SETTING: value}}."""
    result = {}
    for spec in specs:
        name, _, pairs = spec.partition(":")
        result[name] = {
            f"BATCHSERVE_{key.upper()}": value
            for key, value in (pair.split("=", 1) for pair in pairs.split(",") if pair)
        }
    return result


def load(url: str, images: list[bytes], clients: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.client == "wrk":
        return wrk.run(url, images, clients, args.warmup, args.duration)
    spec = LoadSpec(concurrency=clients, warmup_s=args.warmup, duration_s=args.duration)
    return asyncio.run(run_url(url, images, spec))


def offline_limits(args: argparse.Namespace) -> dict[str, float]:
    """The offline limits, measured in a fresh process like each round's servers."""
    command = [
        sys.executable, "-m", "benchmarks.offline", "--model", args.model,
        "--precision", args.precision, "--batch-sizes", str(args.batch_size),
        "--seconds", str(args.duration), "--runs", "1", "--json",
    ] + (["--images", str(args.images)] if args.images else [])  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    (row,) = json.loads(output.strip().splitlines()[-1])
    return {"pipelined": row["pipelined"], "sequential": row["sequential"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    extra = {f"BATCHSERVE_{k.upper()}": v for k, v in (item.split("=", 1) for item in args.set)}
    env = server_env(args.model, args.precision, args.batch_size, **extra)
    samples: dict[str, list[dict[str, Any]]] = {}

    def add(name: str, result: dict[str, Any]) -> None:
        samples.setdefault(name, []).append(result)
        print(f"  {name}: {result['throughput']:.1f} images/s, "
              f"p50 {result['latency_ms']['p50']:.0f} ms", flush=True)  # fmt: skip

    for round_index in range(args.rounds):
        # Fresh processes every round: a process's speed varies with where its memory and
        # threads land, so medians over rounds also average over that.
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        limits = offline_limits(args)
        nan = {"p50": float("nan")}
        add("offline", {"throughput": limits["pipelined"], "latency_ms": nan})
        add("offline_sequential", {"throughput": limits["sequential"], "latency_ms": nan})
        with ExitStack() as stack:
            servers = {
                "batched": UvicornProcess(env),
                **{name: UvicornProcess({**env, **overrides})
                   for name, overrides in variants(args.also).items()},
                "unbatched": UvicornProcess({**env, "BATCHSERVE_MAX_BATCH_SIZE": "1"}),
                "naive": UvicornProcess(env, app="benchmarks.naive_app:app", ready_path="/docs"),
            }  # fmt: skip
            for server in servers.values():
                stack.callback(server.stop)
                server.start()
            for server in servers.values():
                server.wait_ready()
            for name, server in servers.items():
                add(f"{name}@{args.clients}", load(server.url, images, args.clients, args))
            for name, server in servers.items():
                add(f"{name}@1", load(server.url, images, 1, args))
    return summarize(args, samples)


def summarize(args: argparse.Namespace, samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def throughput(name: str) -> float:
        return median([result["throughput"] for result in samples[name]])

    def latency(name: str, q: str) -> float:
        return median([result["latency_ms"][q] for result in samples[name]])

    many = args.clients
    medians = {
        name: {
            "throughput": throughput(name),
            "p50_ms": latency(name, "p50"),
            "p99_ms": latency(name, "p99") if "@" in name else float("nan"),
            "mean_batch": median([r.get("server", {}).get("mean_batch_size", 0) for r in results]),
            "loadgen_cores": median([r.get("client_cpu_cores", 0.0) for r in results]),
        }
        for name, results in samples.items()
    }
    ratios = {
        "served_vs_offline_pipelined": throughput(f"batched@{many}") / throughput("offline"),
        "offline_pipelined_vs_sequential": throughput("offline") / throughput("offline_sequential"),
        "batched_vs_unbatched": throughput(f"batched@{many}") / throughput(f"unbatched@{many}"),
        "batched_vs_naive": throughput(f"batched@{many}") / throughput(f"naive@{many}"),
        "one_client_p50_batched_vs_unbatched": latency("batched@1", "p50")
        / latency("unbatched@1", "p50"),
        "one_client_p50_batched_vs_naive": latency("batched@1", "p50") / latency("naive@1", "p50"),
    }
    return {
        "machine": machine(),
        "model": args.model,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "clients": many,
        "rounds": args.rounds,
        "duration_s": args.duration,
        "settings": args.set,
        "also": args.also,
        "client": args.client,
        "medians": medians,
        "ratios": ratios,
        "samples": samples,
    }


def markdown(data: dict[str, Any]) -> str:
    rows = [
        [name, m["throughput"], m["p50_ms"], m["p99_ms"], m["mean_batch"], m["loadgen_cores"]]
        for name, m in data["medians"].items()
    ]
    ratio_rows = [[name.replace("_", " "), value] for name, value in data["ratios"].items()]
    settings = ", ".join(data["settings"]) or "defaults"
    if data["also"]:
        settings += "; also measured: " + ", ".join(data["also"])
    return f"""# Served vs offline, batched vs unbatched: {data["model"]} {data["precision"]}

`python -m benchmarks.compare --model {data["model"]} --precision {data["precision"]} \\
--batch-size {data["batch_size"]} --clients {data["clients"]} --rounds {data["rounds"]} \\
--client {data["client"]}`
(server settings: {settings}). Medians of {data["rounds"]} interleaved rounds of
{data["duration_s"]} s per configuration. Closed-loop clients driven by {data["client"]}, on the
same machine as the server (the cores it used are shown).

{table(["configuration", "images/s", "p50 ms", "p99 ms", "mean batch", "loadgen cores"], rows)}

{table(["ratio", "value"], ratio_rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__, batch_size=16)
    load_arguments(parser)
    parser.add_argument(
        "--set", nargs="*", default=[], help="settings for every server, e.g. top_k=1"
    )
    parser.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="more batched servers to measure beside the default one: name:setting=value,...",
    )
    parser.add_argument("--name", help="results/<name>.md (default: compare-<model>)")
    parser.add_argument(
        "--client",
        choices=["auto", "wrk", "httpx"],
        default="auto",
        help="load generator: wrk (C, light) or the httpx one; auto prefers wrk",
    )
    args = parser.parse_args()
    if args.client == "auto":
        args.client = "wrk" if wrk.available() else "httpx"
    data = run(args)
    publish(args.name or f"compare-{args.model}", data, markdown(data))


if __name__ == "__main__":
    main()

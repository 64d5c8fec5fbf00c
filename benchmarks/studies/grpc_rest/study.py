"""REST against gRPC: the same model, the same server process, Triton's own clients.

Every round starts a fresh server (its HTTP and gRPC ports both), then runs a closed loop of
``--clients`` concurrent callers for each protocol and concurrency, the order alternating
between rounds. Each loop is a fresh client process (``tritonclient.http.aio`` for REST,
``tritonclient.grpc.aio`` for gRPC, one JPEG per call as the ``image`` input), which reports
images/s, latency and its own CPU time per call: on one machine the client's CPU is taken from
the server's, so a cheaper client is part of what a protocol saves.

Usage: ``python -m benchmarks grpc_rest --model resnet18 --rounds 3``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    command_line,
    machine,
    machine_markdown,
    median,
    percentile,
    publish,
    table,
)
from benchmarks.corpus import corpus
from harness.servers import UvicornProcess

HERE = Path(__file__).resolve().parent  # the study's report and its runs

PROTOCOLS = ("rest", "grpc")
MODEL_NAME = "model"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _closed_loop(
    protocol: str, target: str, images: list[bytes], clients: int, warmup: float, seconds: float
) -> dict[str, Any]:
    if protocol == "grpc":
        import tritonclient.grpc.aio as triton
    else:
        import tritonclient.http.aio as triton
    client = triton.InferenceServerClient(target)
    inputs = []
    for data in images:
        tensor = triton.InferInput("image", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
        inputs.append(tensor)
    latencies: list[float] = []
    errors = 0
    measuring = False
    start = time.perf_counter()
    stop = start + warmup + seconds

    async def caller(index: int) -> None:
        nonlocal errors
        calls = 0
        while time.perf_counter() < stop:
            began = time.perf_counter()
            try:
                await client.infer(MODEL_NAME, [inputs[(index + calls) % len(inputs)]])
            except Exception:
                if measuring:
                    errors += 1
                continue
            finally:
                calls += 1
            if measuring and time.perf_counter() <= stop:
                latencies.append(time.perf_counter() - began)

    workers = [asyncio.ensure_future(caller(index)) for index in range(clients)]
    await asyncio.sleep(warmup)
    measuring, cpu_before, window_start = True, _cpu_seconds(), time.perf_counter()
    await asyncio.gather(*workers)
    elapsed = time.perf_counter() - window_start
    cpu = _cpu_seconds() - cpu_before
    await client.close()
    done = len(latencies)
    return {
        "protocol": protocol,
        "clients": clients,
        "images_per_second": done / elapsed,
        "errors": errors,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "client_cpu_ms_per_call": cpu / max(done, 1) * 1000,
        "client_cpu_share": cpu / elapsed,
    }


def client_main(args: argparse.Namespace) -> None:
    images = corpus(args.images, 32)
    result = asyncio.run(
        _closed_loop(args.protocol, args.target, images, args.clients, args.warmup, args.seconds)
    )
    print(json.dumps(result))


def _measure(server: UvicornProcess, protocol: str, clients: int, args: argparse.Namespace) -> Any:
    target = server.grpc_target if protocol == "grpc" else server.url.removeprefix("http://")
    command = [
        sys.executable, "-m", "benchmarks.studies.grpc_rest.study", "client",
        "--protocol", protocol,
        "--target", target, "--clients", str(clients), "--warmup", str(args.warmup),
        "--seconds", str(args.seconds),
    ]  # fmt: skip
    if args.images is not None:
        command += ["--images", str(args.images)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {
        "BATCHSERVE_MODEL": args.model,
        "BATCHSERVE_MODEL_NAME": MODEL_NAME,
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_BACKEND": args.backend,
        "BATCHSERVE_MAX_BATCH_SIZE": str(args.batch_size),
        "BATCHSERVE_LOG_LEVEL": "warning",
    }
    samples: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        order = PROTOCOLS if round_index % 2 == 0 else PROTOCOLS[::-1]
        with UvicornProcess(env) as server:
            for clients in args.clients:
                for protocol in order:
                    result = _measure(server, protocol, clients, args)
                    print(f"  {protocol} @{clients}: {result['images_per_second']:.1f} img/s, "
                          f"p50 {result['p50_ms']:.1f} ms", flush=True)  # fmt: skip
                    samples.setdefault(f"{protocol}@{clients}", []).append(result)
    keys = ("images_per_second", "p50_ms", "p99_ms", "client_cpu_ms_per_call",
            "client_cpu_share", "errors")  # fmt: skip
    medians = {name: {key: median([s[key] for s in runs]) for key in keys}
               for name, runs in samples.items()}  # fmt: skip
    return {
        "machine": machine(),
        "settings": vars(args) | {"images": str(args.images) if args.images else None},
        "samples": samples,
        "medians": medians,
    }


def markdown(data: dict[str, Any]) -> str:
    args, medians = data["settings"], data["medians"]
    rows = []
    for clients in args["clients"]:
        rest, grpc = medians[f"rest@{clients}"], medians[f"grpc@{clients}"]
        for name, entry in (("REST", rest), ("gRPC", grpc)):
            rows.append([
                name, clients, entry["images_per_second"],
                entry["images_per_second"] / rest["images_per_second"],
                entry["p50_ms"], entry["p99_ms"], entry["client_cpu_ms_per_call"],
                entry["client_cpu_share"], int(entry["errors"]),
            ])  # fmt: skip
    headers = ["protocol", "clients", "img/s", "/ REST", "p50 ms", "p99 ms",
               "client CPU ms per call", "client CPU (cores)", "errors"]  # fmt: skip
    return "\n".join([
        f"# REST against gRPC: {args['model']} ({args['backend']}), batch {args['batch_size']}",
        "",
        f"`python -m benchmarks grpc_rest --model {args['model']}`: medians of {args['rounds']} "
        f"rounds (a fresh server each round, the protocol order alternating), {args['seconds']} s "
        "closed loops after "
        f"{args['warmup']} s of warm-up, one JPEG per call through Triton's own asyncio clients "
        "(REST: tritonclient.http.aio, gRPC: tritonclient.grpc.aio), each a fresh process on the "
        "same machine as the server.",
        "",
        table(headers, rows),
        "",
        "## Machine",
        "",
        machine_markdown(data["machine"]),
    ])  # fmt: skip


def main() -> None:
    parser = command_line(__doc__, __file__)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="one closed loop (run by the benchmark itself)")
    client.add_argument("--protocol", choices=PROTOCOLS, required=True)
    client.add_argument("--target", required=True)
    client.add_argument("--clients", type=int, required=True)
    for each in (parser, client):
        each.add_argument("--warmup", type=float, default=2.0)
        each.add_argument("--seconds", type=float, default=8.0)
        each.add_argument("--images", type=Path, default=None, help="a folder of images")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if args.command == "client":
        client_main(args)
        return
    data = run(args)
    name = args.name or f"grpc-rest-{args.model}"
    publish(name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""One worker with every CPU against several workers with a share each, on one host.

Per round, with fresh processes: one server (``WORKERS=1``: all CPUs, that many threads)
and then ``--workers`` servers (``WORKERS=n``, ``WORKER_INDEX=i``: each pinned to its share
of the CPUs, with as many threads), as supervisord starts them, on ports of their own. wrk
drives them closed loop: at many clients the load is split evenly between the workers (a
wrk per port, as a round-robin balancer would), at one client a lone client talks to one
worker. Medians over rounds.

Usage: ``python -m benchmarks workers --model resnet18 --rounds 3``
"""

from __future__ import annotations

import argparse
import concurrent.futures
from contextlib import ExitStack
from pathlib import Path
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
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from harness.servers import UvicornProcess

HERE = Path(__file__).resolve().parent  # the study's report and its runs


def drive(urls: list[str], images: list[bytes], clients: int, args: argparse.Namespace
          ) -> dict[str, float]:  # fmt: skip
    """Closed loop, ``clients`` split evenly over ``urls``, all at once."""
    share = max(1, clients // len(urls))
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
        results = list(pool.map(
            lambda url: wrk.run(url, images, share, args.warmup, args.duration), urls
        ))  # fmt: skip
    return {
        "throughput": sum(result["throughput"] for result in results),
        "p50_ms": median([result["latency_ms"]["p50"] for result in results]),
        "p99_ms": max(result["latency_ms"]["p99"] for result in results),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    env = server_env(args.model, args.precision, args.batch_size)
    samples: dict[str, list[dict[str, float]]] = {}
    layouts = {"1 worker": 1, f"{args.workers} workers": args.workers}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        for name, count in layouts.items():
            with ExitStack() as stack:
                servers = [
                    UvicornProcess({**env, "BATCHSERVE_WORKERS": str(count),
                                    "BATCHSERVE_WORKER_INDEX": str(index)})
                    for index in range(count)
                ]  # fmt: skip
                for server in servers:
                    stack.callback(server.stop)
                    server.start()
                for server in servers:
                    server.wait_ready()
                urls = [server.url for server in servers]
                for clients in (args.clients, 1):
                    result = drive(urls if clients > 1 else urls[:1], images, clients, args)
                    samples.setdefault(f"{name}@{clients}", []).append(result)
                    print(f"  {name} @ {clients}: {result['throughput']:.1f} images/s, "
                          f"p50 {result['p50_ms']:.0f} ms", flush=True)  # fmt: skip
    medians = {key: {measure: median([row[measure] for row in rows]) for measure in rows[0]}
               for key, rows in samples.items()}  # fmt: skip
    return {"machine": machine(), "model": args.model, "precision": args.precision,
            "batch_size": args.batch_size, "workers": args.workers, "clients": args.clients,
            "rounds": args.rounds, "duration_s": args.duration, "medians": medians,
            "samples": samples}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    rows = [[key, m["throughput"], m["p50_ms"], m["p99_ms"]]
            for key, m in data["medians"].items()]  # fmt: skip
    title = f"{data['model']} {data['precision']}, batch {data['batch_size']}"
    return f"""# Workers on one host: {title}

`python -m benchmarks workers`: one worker with every CPU against {data["workers"]} workers
pinned to a share each (`WORKERS` / `WORKER_INDEX`), at {data["clients"]} clients (split
evenly over the workers) and at 1; medians of {data["rounds"]} rounds of {data["duration_s"]} s
with fresh processes. Throughput is the sum over the workers; p99 the worst of them.

{table(["layout @ clients", "images/s", "p50 ms", "p99 ms"], rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--workers", type=int, default=2)
    load_arguments(parser)
    parser.add_argument("--name", help="results/<name>.* (default: workers-<model>)")
    args = parser.parse_args()
    data = run(args)
    publish(args.name or f"workers-{args.model}", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

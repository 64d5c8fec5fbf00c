"""Reloads under load: does every request get its answer, how long a reload takes, and does
the memory of a process that reloads a model over and over stay bounded?

A server with a repository of one model (``MODEL_CONTROL=explicit``) is kept busy by wrk while
``POST /v2/repository/models/<name>/load`` is called ``--reloads`` times, one after the other;
each builds the model's versions anew, switches, then frees the old ones. After every reload
the process's resident memory is read from ``/metrics``; the report gives each reload's time
and RSS, every answer's status, and RSS growth from the fifth reload to the last.

Usage: ``python -m benchmarks reload --model resnet18 --reloads 20``
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import wrk
from benchmarks.common import command_line, machine, machine_markdown, publish, table
from benchmarks.corpus import corpus
from harness.promtext import parse, value
from harness.servers import UvicornProcess

HERE = Path(__file__).resolve().parent  # the study's report and its runs


def rss(url: str) -> float:
    return value(parse(httpx.get(f"{url}/metrics").text), "process_resident_memory_bytes")


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 32)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "m" / "1").mkdir(parents=True)
        (root / "m" / "config.toml").write_text(
            f'model = "{args.model}"\nweights = "none"\nprecision = "fp32"\nmax_batch_size = 8\n'
        )
        env = {"BATCHSERVE_MODEL_REPOSITORY": str(root), "BATCHSERVE_MODEL_CONTROL": "explicit",
               "BATCHSERVE_LOG_LEVEL": "warning"}  # fmt: skip
        with UvicornProcess(env) as server:
            url = server.url
            before = rss(url)
            reloads: list[dict[str, Any]] = []
            load: dict[str, Any] = {}
            duration = args.reloads * args.seconds_per_reload + 10

            def busy() -> None:
                load.update(wrk.run(url, images, args.clients, 0, duration))

            loader = threading.Thread(target=busy)
            loader.start()
            time.sleep(3)
            for index in range(args.reloads):
                started = time.perf_counter()
                response = httpx.post(f"{url}/v2/repository/models/m/load", timeout=300)
                took = time.perf_counter() - started
                reloads.append({"reload": index + 1, "status": response.status_code,
                                "seconds": took, "rss_mb": rss(url) / 2**20})  # fmt: skip
                print(reloads[-1], flush=True)
                time.sleep(max(0.0, args.seconds_per_reload - took))
            loader.join()
            after = rss(url)
    fifth, last = reloads[min(4, len(reloads) - 1)]["rss_mb"], reloads[-1]["rss_mb"]
    return {"machine": machine(), "model": args.model, "clients": args.clients,
            "reloads": reloads, "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20,
            "growth_after_fifth_mb": last - fifth, "load": load}  # fmt: skip


def markdown(data: dict[str, Any]) -> str:
    load = data["load"]
    rows = [[r["reload"], r["status"], r["seconds"], r["rss_mb"]] for r in data["reloads"]]
    errors = load.get("errors") or "none"
    return f"""# Reload under load: {data["model"]}

`python -m benchmarks reload --model {data["model"]}`: {len(data["reloads"])} reloads of one
model (version 1 built anew each time, then switched, the old one freed) while
{data["clients"]} wrk clients send `/predict` without pause.

- answers during the run: {load.get("completed")} requests, {load.get("ok")} answered 200;
  errors (non-2xx, timeouts, resets): {errors}; p99 {load.get("latency_ms", {}).get("p99")} ms
- resident memory: {data["rss_before_mb"]:.0f} MiB before the first reload,
  {data["rss_after_mb"]:.0f} MiB after the last; from the fifth reload to the last:
  {data["growth_after_fifth_mb"]:+.1f} MiB

{table(["reload", "status", "seconds", "RSS MiB"], rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--reloads", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds-per-reload", type=float, default=6.0)
    parser.add_argument("--images", type=Path)
    parser.add_argument("--name", help="results/<name>.* (default: reload-<model>)")
    args = parser.parse_args()
    data = run(args)
    publish(args.name or f"reload-{args.model}", data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""Overload soak: offer several times the measured capacity for a while, on loopback only,
and check that the server degrades the way it should.

Reports: no 5xx other than 503 (queue full) and 504 (deadline); the 503s answered fast;
accepted requests answered within their deadline; the server's memory (RSS) at start, peak and
end; and that it answers normally afterwards.

Usage: ``python -m benchmarks.soak --model resnet18 --factor 4 --duration 60``
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import wrk
from benchmarks.common import (
    machine,
    machine_markdown,
    model_arguments,
    publish,
    table,
)
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from benchmarks.loadgen import LoadSpec, run_url
from harness.servers import UvicornProcess


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.samples = pid, 0, [rss_bytes(pid)]
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append(rss_bytes(self.pid))
            self.peak = max(self.peak, self.samples[-1])


def capacity(url: str, images: list[bytes]) -> float:
    if wrk.available():
        return float(wrk.run(url, images, 64, 2, 6)["throughput"])
    result = asyncio.run(run_url(url, images, LoadSpec(64, None, 2, 6)))
    return float(result["throughput"])


def soak(args: argparse.Namespace) -> dict[str, Any]:
    images = corpus(args.images, 64)
    env = server_env(
        args.model, args.precision, args.batch_size,
        BATCHSERVE_MAX_QUEUE_SIZE=str(args.queue_size),
        BATCHSERVE_REQUEST_TIMEOUT_MS=str(args.timeout_ms),
    )  # fmt: skip
    with UvicornProcess(env) as server:
        assert server.url.startswith("http://127.0.0.1:"), "the soak only runs on loopback"
        assert server.process is not None
        measured = args.capacity or capacity(server.url, images)
        rate = measured * args.factor
        print(f"capacity {measured:.1f}/s; offering {rate:.1f}/s for {args.duration:g} s",
              flush=True)  # fmt: skip
        rss_start = rss_bytes(server.process.pid)
        sampler = RssSampler(server.process.pid)
        sampler.start()
        spec = LoadSpec(None, rate=rate, warmup_s=2, duration_s=args.duration, timeout_s=60)
        result = asyncio.run(run_url(server.url, images, spec, progress=True))
        sampler.stop.set()
        sampler.join()
        time.sleep(1)
        rss_end = rss_bytes(server.process.pid)
        started = time.perf_counter()
        after = httpx.post(f"{server.url}/predict", content=images[0],
                           headers={"content-type": "image/jpeg"}, timeout=30)  # fmt: skip
        after_ms = (time.perf_counter() - started) * 1000
        ready = httpx.get(f"{server.url}/readyz").status_code
    statuses = {status: stats["count"] for status, stats in result["latency_ms_by_status"].items()}
    bad_5xx = {s: n for s, n in statuses.items() if s.isdigit() and s[0] == "5" and s not in
               ("503", "504")}  # fmt: skip
    other = {s: n for s, n in statuses.items() if not s.isdigit()}
    return {
        "machine": machine(),
        "model": args.model,
        "capacity_per_s": measured,
        "offered_per_s": rate,
        "duration_s": args.duration,
        "queue_size": args.queue_size,
        "timeout_ms": args.timeout_ms,
        "statuses": statuses,
        "unexpected_5xx": bad_5xx,
        "transport_errors": other,
        "latency_ms_by_status": result["latency_ms_by_status"],
        "throughput": result["throughput"],
        "server": result["server"],
        "rss_mb": {
            "start": rss_start / 2**20,
            "peak": sampler.peak / 2**20,
            "end": rss_end / 2**20,
        },
        "after": {"status": after.status_code, "latency_ms": after_ms, "readyz": ready},
        "passed": not bad_5xx and not other and after.status_code == 200 and ready == 200,
    }


def markdown(data: dict[str, Any]) -> str:
    rows = [[status, stats["count"], stats["p50"], stats["p99"], stats["max"], stats["server_p50"],
             stats["server_p99"]]
            for status, stats in sorted(data["latency_ms_by_status"].items())]  # fmt: skip
    rss = data["rss_mb"]
    after = data["after"]
    return f"""# Overload soak: {data["model"]}

Offered {data["offered_per_s"]:.0f} requests/s (Poisson) for {data["duration_s"]:g} s against a
measured capacity of {data["capacity_per_s"]:.1f} images/s; `MAX_QUEUE_SIZE={data["queue_size"]}`,
`REQUEST_TIMEOUT_MS={data["timeout_ms"]}` (`python -m benchmarks.soak`).

{table(["status", "count", "p50 ms", "p99 ms", "max ms", "server p50 ms", "server p99 ms"], rows)}

Client-side latency counts from the scheduled send time, so it includes the load generator's
own delays: it shares the machine's cores with the server. The server columns are the
`Server-Timing` total, from the request's arrival in the app to its answer.

- served {data["throughput"]:.1f} images/s while overloaded; mean batch
  {data["server"]["mean_batch_size"]:.1f}; server outcomes {data["server"]["outcomes"]}
- 5xx other than 503/504: {data["unexpected_5xx"] or "none"}; transport errors:
  {data["transport_errors"] or "none"}
- server RSS: {rss["start"]:.0f} MB at start, {rss["peak"]:.0f} MB peak, {rss["end"]:.0f} MB at end
- afterwards: /predict answered {after["status"]} in {after["latency_ms"]:.0f} ms, /readyz
  {after["readyz"]}

**{"PASS" if data["passed"] else "FAIL"}**

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--capacity", type=float, help="skip measuring it")
    parser.add_argument("--queue-size", type=int, default=64)
    parser.add_argument("--timeout-ms", type=float, default=2000)
    parser.add_argument("--images", type=Path)
    parser.add_argument("--name", help="results/<name>.* (default: soak-<model>)")
    args = parser.parse_args()
    data = soak(args)
    publish(args.name or f"soak-{args.model}", data, markdown(data))


if __name__ == "__main__":
    main()

"""Load generator for ``POST /predict``: closed loop (N clients) or open loop (Poisson arrivals).

Open-loop latency is measured from each request's *scheduled* send time, so a slow server
cannot hide its queueing by slowing the generator down (no coordinated omission). Both modes
run a warm-up, then a timed window; ``/metrics`` is scraped before and after the window for
the server's view (mean batch size, queue wait, per-stage time, device busy ratio).

Each virtual client has its own ``httpx.AsyncClient`` (one connection, as real clients do):
one shared pool of many connections costs httpcore several times more CPU per request, CPU
that a load generator on the server's machine takes from the server. The report says how much
CPU the generator itself used.

Usage::

    python -m benchmarks.loadgen --url http://127.0.0.1:8000 --concurrency 64 --duration 20
    python -m benchmarks.loadgen --url http://127.0.0.1:8000 --rate 40 --duration 30 --json out.json
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import command_line, percentile, table
from benchmarks.corpus import content_type, corpus
from harness.promtext import Samples, ServerDelta, from_response


@dataclass
class Window:
    """What happened inside the timed window."""

    started: float
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    by_status: dict[str, list[float]] = field(default_factory=dict)  # every answer's latency
    server_by_status: dict[str, list[float]] = field(default_factory=dict)  # Server-Timing total
    statuses: Counter[int | str] = field(default_factory=Counter)
    open: bool = True
    client_cpu_s: float = 0.0


@dataclass
class LoadSpec:
    concurrency: int | None = 64  # closed loop
    rate: float | None = None  # open loop, requests per second
    warmup_s: float = 2.0
    duration_s: float = 10.0
    timeout_s: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate else f"{self.concurrency} clients"


async def run(
    clients: Sequence[httpx.AsyncClient],
    images: list[bytes],
    spec: LoadSpec,
    progress: bool = False,
) -> dict[str, Any]:
    """Drive the server behind ``clients`` (base URL or ASGI transport) and return the report.

    Closed loop: one client per virtual client. Open loop: requests go round-robin.
    """
    payloads = [(data, {"content-type": content_type(data), **spec.headers}) for data in images]
    cycle = itertools.cycle(payloads)
    rotation = itertools.cycle(clients)
    window = Window(started=0.0, open=False)
    cpu_started = time.process_time()

    async def one(scheduled: float, client: httpx.AsyncClient) -> None:
        data, headers = next(cycle)
        try:
            response = await client.post("/predict", content=data, headers=headers,
                                         timeout=spec.timeout_s)  # fmt: skip
            outcome: int | str = response.status_code
            server_ms = _server_total_ms(response.headers.get("server-timing", ""))
        except httpx.HTTPError as exc:
            outcome, server_ms = type(exc).__name__, None
        finished = time.perf_counter()
        if window.open and scheduled >= window.started:
            window.statuses[outcome] += 1
            window.by_status.setdefault(str(outcome), []).append(finished - scheduled)
            if server_ms is not None:
                window.server_by_status.setdefault(str(outcome), []).append(server_ms / 1000)
            if outcome == 200:
                window.latencies.append(finished - scheduled)

    stop_at = time.perf_counter() + spec.warmup_s + spec.duration_s

    async def closed_client(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            await one(time.perf_counter(), client)

    async def open_loop() -> None:
        assert spec.rate
        rng = random.Random(1)
        tasks: set[asyncio.Task[None]] = set()
        next_send = time.perf_counter()
        while next_send < stop_at:
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(next_send, next(rotation)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_send += rng.expovariate(spec.rate)
        if tasks:
            await asyncio.wait(tasks, timeout=spec.timeout_s)

    async def timekeeper() -> ServerDelta:
        nonlocal cpu_started
        await asyncio.sleep(spec.warmup_s)
        before = await scrape(clients[0])
        window.started = time.perf_counter()
        cpu_started = time.process_time()
        window.open = True
        while time.perf_counter() < stop_at:
            await asyncio.sleep(0.5)
            if progress:
                elapsed = time.perf_counter() - window.started
                done = sum(window.statuses.values())
                rate = done / max(elapsed, 1e-9)
                line = f"\r  {spec.label}: {elapsed:5.1f}s  {done} done  {rate:7.1f}/s"
                print(line, end="", file=sys.stderr, flush=True)
        window.open = False
        ended = time.perf_counter()
        window.client_cpu_s = time.process_time() - cpu_started
        after = await scrape(clients[0])
        if progress:
            print(file=sys.stderr)
        return ServerDelta(before, after, ended - window.started)

    keeper = asyncio.create_task(timekeeper())
    if spec.rate:
        await open_loop()
    else:
        await asyncio.gather(*(closed_client(client) for client in clients))
    delta = await keeper
    return report(spec, window, delta)


def _server_total_ms(header: str) -> float | None:
    for part in header.split(","):
        name, _, value = part.strip().partition(";dur=")
        if name == "total" and value:
            return float(value)
    return None


async def scrape(client: httpx.AsyncClient) -> Samples:
    """The server's metrics, or nothing when it has none (a baseline server)."""
    return from_response(await client.get("/metrics"))


def report(spec: LoadSpec, window: Window, delta: ServerDelta) -> dict[str, Any]:
    latencies = window.latencies
    ok = window.statuses.get(200, 0)
    return {
        "mode": "open" if spec.rate else "closed",
        "concurrency": spec.concurrency if not spec.rate else None,
        "offered_rate": spec.rate,
        "duration_s": delta.seconds,
        "completed": sum(window.statuses.values()),
        "ok": ok,
        "throughput": ok / delta.seconds if delta.seconds else 0.0,
        "errors": {str(k): v for k, v in window.statuses.items() if k != 200},
        # Cores the load generator itself kept busy (it shares the machine with the server).
        "client_cpu_cores": window.client_cpu_s / delta.seconds if delta.seconds else 0.0,
        "latency_ms": {
            name: percentile(latencies, q) * 1000
            for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9), ("max", 100))
        },
        "latency_ms_by_status": {
            status: {
                "count": len(values),
                "p50": percentile(values, 50) * 1000,
                "p99": percentile(values, 99) * 1000,
                "max": max(values) * 1000,
                # Inside the server (Server-Timing total): without the client's own delays.
                "server_p50": percentile(window.server_by_status.get(status, []), 50) * 1000,
                "server_p99": percentile(window.server_by_status.get(status, []), 99) * 1000,
            }
            for status, values in window.by_status.items()
        },
        "server": delta.summary(),
    }


def format_report(result: dict[str, Any]) -> str:
    lat = result["latency_ms"]
    server = result["server"]
    load = (f"{result['offered_rate']:g}/s offered" if result["mode"] == "open"
            else f"{result['concurrency']} clients")  # fmt: skip
    rows = [[load, result["throughput"], lat["p50"], lat["p90"], lat["p99"], lat["p99.9"],
             lat["max"], server["mean_batch_size"], server["mean_queue_wait_ms"],
             server["device_busy_ratio"], result["client_cpu_cores"],
             json.dumps(result["errors"]) if result["errors"] else "-"]]  # fmt: skip
    head = ["load", "images/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms",
            "mean batch", "queue wait ms", "device busy", "loadgen cores", "errors"]  # fmt: skip
    stages = ", ".join(f"{k} {v:.2f}" for k, v in server["mean_stage_ms"].items())
    return table(head, rows) + f"\n\nmean stage ms: {stages}"


async def run_url(
    url: str, images: list[bytes], spec: LoadSpec, progress: bool = False, open_clients: int = 256
) -> dict[str, Any]:
    context = ssl.create_default_context()  # made once: each client would load it again
    count = spec.concurrency or 1 if not spec.rate else open_clients
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=spec.timeout_s, verify=context)
            )
            for _ in range(count)
        ]
        return await run(clients, images, spec, progress)


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=64, help="closed loop clients")
    parser.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--images", type=Path, help="a folder of images (default: generated)")
    parser.add_argument("--count", type=int, default=64, help="images in the corpus")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    spec = LoadSpec(args.concurrency, args.rate, args.warmup, args.duration)
    result = asyncio.run(run_url(args.url, corpus(args.images, args.count), spec, True))
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

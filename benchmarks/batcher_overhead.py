"""What the batcher itself costs: a no-op ``run_batch``, beside bare asyncio baselines.

Two measurements, each the median of several runs in this one process:

- **sequential**: one client, submit → result, one request at a time. The batcher hands each
  (lone) request to a worker thread, so the baseline is a bare ``run_in_executor`` call.
- **saturated**: many concurrent clients in a closed loop. The event loop is the bottleneck,
  so wall time per request is the CPU cost per request; the highest sustainable submit rate
  is its inverse. The baseline is the same clients awaiting bare futures resolved by
  ``call_soon``: the least asyncio can do per request.

Usage: ``python -m benchmarks.batcher_overhead [--requests N] [--runs R]``
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batching import BatchConfig, BatchObserver, DynamicBatcher
from benchmarks.common import command_line, machine, machine_markdown, median, table, write_results


def noop(items: list[int]) -> list[int]:
    return items


class BatchSizes(BatchObserver):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self.sizes.append(batch_size)


async def bare_futures(requests: int, clients: int) -> float:
    """Each request: a future resolved on the next loop iteration."""
    loop = asyncio.get_running_loop()

    async def client(count: int) -> None:
        for index in range(count):
            future: asyncio.Future[int] = loop.create_future()
            loop.call_soon(future.set_result, index)
            await future

    return await _timed(requests, clients, client)


async def bare_executor(requests: int, clients: int) -> float:
    """Each request: a hop to a worker thread and back (an unbatched server's minimum)."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=2)

    async def client(count: int) -> None:
        for index in range(count):
            await loop.run_in_executor(executor, noop, [index])

    try:
        return await _timed(requests, clients, client)
    finally:
        executor.shutdown()


async def through_batcher(requests: int, clients: int, config: BatchConfig) -> tuple[float, float]:
    """Seconds per request, and the mean batch size."""
    sizes = BatchSizes()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(noop, config, sizes)
    batcher.start()

    async def client(count: int) -> None:
        for index in range(count):
            await batcher.submit(index)

    try:
        seconds = await _timed(requests, clients, client)
    finally:
        await batcher.aclose()
    return seconds, sum(sizes.sizes) / max(1, len(sizes.sizes))


async def _timed(requests: int, clients: int, client: Callable[[int], Awaitable[None]]) -> float:
    per_client = requests // clients
    started = time.perf_counter()
    await asyncio.gather(*(client(per_client) for _ in range(clients)))
    return (time.perf_counter() - started) / (per_client * clients)


def run(requests: int, runs: int, clients: int) -> dict[str, Any]:
    config = BatchConfig(max_batch_size=64, max_queue_delay_s=0.002, max_queue_size=100_000)
    samples: dict[str, list[float]] = {
        "sequential_bare_executor": [],
        "sequential_batcher": [],
        "saturated_bare_futures": [],
        "saturated_batcher": [],
    }
    batch_sizes: list[float] = []
    for _ in range(runs):
        sequential = max(200, requests // 20)
        samples["sequential_bare_executor"].append(asyncio.run(bare_executor(sequential, 1)))
        seconds, _ = asyncio.run(through_batcher(sequential, 1, config))
        samples["sequential_batcher"].append(seconds)
        samples["saturated_bare_futures"].append(asyncio.run(bare_futures(requests, clients)))
        seconds, mean_batch = asyncio.run(through_batcher(requests, clients, config))
        samples["saturated_batcher"].append(seconds)
        batch_sizes.append(mean_batch)
    medians = {name: median(values) for name, values in samples.items()}
    return {
        "machine": machine(),
        "requests": requests,
        "clients": clients,
        "runs": runs,
        "config": {"max_batch_size": 64, "max_queue_delay_ms": 2},
        "samples_us": {k: [v * 1e6 for v in vs] for k, vs in samples.items()},
        "median_us": {name: value * 1e6 for name, value in medians.items()},
        "sequential_overhead_us": (
            medians["sequential_batcher"] - medians["sequential_bare_executor"]
        )
        * 1e6,
        "saturated_overhead_us": (medians["saturated_batcher"] - medians["saturated_bare_futures"])
        * 1e6,
        "max_submit_rate_per_s": 1 / medians["saturated_batcher"],
        "bare_future_rate_per_s": 1 / medians["saturated_bare_futures"],
        "mean_batch_size_saturated": median(batch_sizes),
    }


def report(data: dict[str, Any]) -> str:
    m = data["median_us"]
    rows = [
        ["1 client", "bare run_in_executor hop", m["sequential_bare_executor"], "-"],
        ["1 client", "DynamicBatcher.submit", m["sequential_batcher"],
         data["sequential_overhead_us"]],
        [f"{data['clients']} clients", "bare future + call_soon", m["saturated_bare_futures"], "-"],
        [f"{data['clients']} clients", "DynamicBatcher.submit", m["saturated_batcher"],
         data["saturated_overhead_us"]],
    ]  # fmt: skip
    return f"""# Batcher overhead

No-op `run_batch`; medians of {data["runs"]} runs of {data["requests"]} requests
(`python -m benchmarks.batcher_overhead`).

{table(["load", "path", "µs per request", "batcher overhead µs"], rows)}

- Highest sustainable submit rate: **{data["max_submit_rate_per_s"]:,.0f} requests/s** on one
  event loop (bare futures: {data["bare_future_rate_per_s"]:,.0f}/s), mean batch size
  {data["mean_batch_size_saturated"]:.1f}.
- Overhead per request: {data["saturated_overhead_us"]:.1f} µs under saturation,
  {data["sequential_overhead_us"]:.1f} µs for a lone request (beyond the worker-thread hop that
  an unbatched server pays too).

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    data = run(args.requests, args.runs, args.clients)
    text = report(data)
    print(text)
    if not args.no_write:
        write_results("batcher_overhead", data, text)


if __name__ == "__main__":
    main()

"""The event loop's CPU per thread hand-off: ``loop.run_in_executor`` against ``LoopThreads``.

Every image decoded and every batch run is one hand-off from the event loop to a thread and
back. In one process, in alternating rounds, ``--clients`` coroutines send ``--jobs`` small
jobs (a few microseconds of Python each) to two threads, at most two at a time as the decode
pool runs them, through each way; ``time.thread_time()`` of the event loop's thread divided
by the jobs is its CPU per hand-off.

Usage: ``python -m benchmarks handoff``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvloop

from batching.threads import LoopThreads
from benchmarks.common import command_line, machine, machine_markdown, median, publish, table

HERE = Path(__file__).resolve().parent  # the study's report and its runs

WORKERS = 2


def job(value: int) -> int:
    total = 0
    for step in range(200):
        total += step
    return value + total


async def cpu_per_job(run: Callable[[int], Awaitable[int]], jobs: int, clients: int) -> float:
    """Microseconds of the event loop's CPU per hand-off."""
    free = asyncio.Semaphore(WORKERS)
    indices = iter(range(jobs))

    async def client() -> None:
        for index in indices:
            async with free:
                await run(index)

    started = time.thread_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    return (time.thread_time() - started) / jobs * 1e6


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="executor")
    threads = LoopThreads(WORKERS, "threads")
    ways: dict[str, Callable[[int], Awaitable[int]]] = {
        "run_in_executor": lambda value: loop.run_in_executor(executor, job, value),
        "LoopThreads": lambda value: threads.run(job, value),
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for way in ways.values():  # threads started, caches warm
            await cpu_per_job(way, 1000, args.clients)
        for _ in range(args.rounds):
            for name, way in ways.items():
                samples[name].append(await cpu_per_job(way, args.jobs, args.clients))
    finally:
        executor.shutdown(wait=True)
        threads.shutdown(wait=True)
    return samples


def markdown(data: dict[str, Any]) -> str:
    executor = median(data["samples"]["run_in_executor"])
    threads = median(data["samples"]["LoopThreads"])
    rows = [
        ["`loop.run_in_executor` (a `ThreadPoolExecutor`)", executor, 1.0],
        ["`LoopThreads.run` (batching/threads.py)", threads, threads / executor],
    ]
    rounds = "; ".join(
        f"{name} {', '.join(f'{value:.1f}' for value in values)}"
        for name, values in data["samples"].items()
    )
    return f"""# The event loop's CPU per thread hand-off

`python -m benchmarks handoff`: {data["jobs"]} jobs per round from {data["clients"]}
coroutines to {WORKERS} threads, medians of {data["rounds"]} alternating rounds in one process
on uvloop.

{table(["hand-off", "event loop µs per job", "ratio"], rows)}

Rounds (µs): {rounds}.

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = command_line(__doc__, __file__)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="handoff")
    args = parser.parse_args()
    samples = uvloop.run(measure(args))
    data = {"machine": machine(), "jobs": args.jobs, "clients": args.clients,
            "rounds": args.rounds, "samples": samples}  # fmt: skip
    publish(args.name, data, markdown(data), folder=HERE)


if __name__ == "__main__":
    main()

"""Decoding in priority order: a free decode thread goes to the most urgent waiting job."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from app.serving.decoding import PriorityPool
from batching.threads import LoopThreads
from tests.fakes import settle, until


@contextmanager
def threads(workers: int) -> Iterator[LoopThreads]:
    pool = LoopThreads(workers, "decode")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


async def test_the_most_urgent_waiting_job_gets_the_next_thread() -> None:
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> str:
        if name == "blocker":
            gate.wait(10)
        order.append(name)
        return name

    with threads(1) as workers:
        pool = PriorityPool(workers)
        blocker = asyncio.ensure_future(pool.run(1, job, "blocker"))
        await settle()
        # Arrival order: two low, a cancelled one, then a high and a second high.
        low = [asyncio.ensure_future(pool.run(2, job, f"low{index}")) for index in range(2)]
        gone = asyncio.ensure_future(pool.run(0, job, "gone"))
        high = [asyncio.ensure_future(pool.run(0, job, f"high{index}")) for index in range(2)]
        await settle()
        assert pool.waiting == 5
        gone.cancel()
        await settle()
        gate.set()
        await asyncio.gather(blocker, *low, *high)
    assert order == ["blocker", "high0", "high1", "low0", "low1"]
    assert pool.waiting == 0


async def test_a_free_thread_is_not_lost_to_a_cancelled_wait() -> None:
    with threads(2) as workers:
        pool = PriorityPool(workers)
        gate = threading.Event()
        running = [asyncio.ensure_future(pool.run(1, gate.wait, 10)) for _ in range(2)]
        await settle()
        waiting = [asyncio.ensure_future(pool.run(1, lambda: "ok")) for _ in range(3)]
        await settle()
        waiting[0].cancel()
        gate.set()
        await asyncio.gather(*running)
        assert [await task for task in waiting[1:]] == ["ok", "ok"]
        # Both threads are free again: two jobs start at once without waiting.
        both = threading.Barrier(2, timeout=5)
        await asyncio.gather(pool.run(1, both.wait), pool.run(1, both.wait))
        await until(lambda: pool.waiting == 0)

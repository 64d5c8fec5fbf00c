"""Fakes for batcher tests: a gated ``run_batch`` and an observer that records everything."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batching import BatchObserver


async def settle(rounds: int = 20) -> None:
    """Let every ready task run (the batcher reacts to a clock step within a few rounds)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def until(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Wait (real time, bounded) for something a worker thread does."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


@dataclass
class Recorder(BatchObserver):
    dispatched: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    drops: list[tuple[str, float]] = field(default_factory=list)
    rejects: list[str] = field(default_factory=list)
    completed: list[tuple[int, BaseException | None]] = field(default_factory=list)
    expired_in_flight: int = 0

    def on_reject(self, reason: str) -> None:
        self.rejects.append(reason)

    def on_drop(self, reason: str, queue_wait_s: float) -> None:
        self.drops.append((reason, queue_wait_s))

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self.dispatched.append(batch_size)
        self.waits.extend(queue_waits_s)

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        self.completed.append((batch_size, error))

    def on_expired_in_flight(self) -> None:
        self.expired_in_flight += 1


class GatedRun:
    """A ``run_batch`` that records its batch, signals an ``asyncio.Event``, then blocks in its
    worker thread until the test opens the gate of that batch.

    Results are ``compute(item)``, or the exception it returns or raises for that item.
    """

    def __init__(
        self,
        compute: Callable[[int], object] = lambda item: item * 10,
        *,
        gated: bool = True,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.compute = compute
        self.gated = gated
        self.batches: list[list[int]] = []
        self.started: list[asyncio.Event] = []
        self._gates: list[threading.Event] = []
        self._lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.fail_batch: set[int] = set()

    def __call__(self, items: list[int]) -> list[object]:
        with self._lock:
            index = len(self.batches)
            self.batches.append(list(items))
            gate = threading.Event()
            self._gates.append(gate)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        started = asyncio.Event()
        self.started.append(started)
        self.loop.call_soon_threadsafe(started.set)
        try:
            if self.gated and not gate.wait(timeout=30):
                raise TimeoutError("the test never opened this batch's gate")
            if index in self.fail_batch:
                raise RuntimeError(f"batch {index} failed")
            results: list[object] = []
            for item in items:
                try:
                    results.append(self.compute(item))
                except Exception as exc:
                    results.append(exc)
            return results
        finally:
            with self._lock:
                self.running -= 1

    async def wait_started(self, count: int) -> None:
        await until(lambda: len(self.started) >= count)
        await self.started[count - 1].wait()

    def release(self, index: int | None = None) -> None:
        """Open one batch's gate, or (None) every gate, present and future."""
        if index is None:
            self.gated = False
            for gate in self._gates:
                gate.set()
        else:
            self._gates[index].set()

"""Every request the batcher took ends with a result or an error, whatever else fails."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from batching import (
    BatchConfig,
    BatcherClosedError,
    BatchObserver,
    DeadlineExceededError,
    DynamicBatcher,
    ManualClock,
    QueueFullError,
)
from tests.fakes import GatedRun, settle

HOOKS = ("on_reject", "on_drop", "on_dispatch", "on_complete", "on_expired_in_flight")


class RaisingObserver(BatchObserver):
    """Raises from one hook, every time it is called."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.calls: list[str] = []

    def _maybe_raise(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.hook:
            raise RuntimeError(f"{hook} is broken")

    def on_reject(self, reason: Any) -> None:
        self._maybe_raise("on_reject")

    def on_drop(self, reason: Any, queue_wait_s: float) -> None:
        self._maybe_raise("on_drop")

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self._maybe_raise("on_dispatch")

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        self._maybe_raise("on_complete")

    def on_expired_in_flight(self) -> None:
        self._maybe_raise("on_expired_in_flight")


async def answered(task: asyncio.Future[Any]) -> Any:
    """The task's result or exception; a hang is a failure, not a slow test."""
    try:
        return await asyncio.wait_for(task, timeout=5)
    except TimeoutError:
        raise AssertionError("a submit never returned: its request was orphaned") from None
    except Exception as exc:
        return exc


@pytest.mark.parametrize("hook", HOOKS)
async def test_a_raising_observer_never_orphans_a_request(hook: str) -> None:
    clock = ManualClock()
    run = GatedRun()
    observer = RaisingObserver(hook)
    config = BatchConfig(
        max_batch_size=2, max_queue_size=4, max_inflight_batches=1, max_queue_delay_s=0.0
    )
    batcher: DynamicBatcher[int, Any] = DynamicBatcher(run, config, observer, clock=clock)
    batcher.start()

    first = asyncio.ensure_future(batcher.submit(1))  # dispatched at once: on_dispatch
    await run.wait_started(1)
    expires_in_flight = first
    late = asyncio.ensure_future(batcher.submit(2, deadline=clock.now() + 1.0))
    cancelled = asyncio.ensure_future(batcher.submit(3))
    plain = [asyncio.ensure_future(batcher.submit(item)) for item in (4, 5)]
    await settle()
    with pytest.raises(QueueFullError):  # on_reject
        await batcher.submit(6)
    cancelled.cancel()  # on_drop("cancelled")
    clock.advance(1.0)  # request 2 expires in the queue: on_drop("deadline_exceeded")
    await settle()
    run.release()  # on_complete, then the plain requests run

    assert await answered(expires_in_flight) == 10
    assert isinstance(await answered(late), DeadlineExceededError)
    assert [await answered(task) for task in plain] == [40, 50]
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert hook in observer.calls or hook == "on_expired_in_flight"

    # And a deadline passing while the batch runs: on_expired_in_flight.
    run.gated = True
    before = len(run.batches)
    # (Beyond the 1 s the first batch took: one that could not finish in time is not run.)
    running = asyncio.ensure_future(batcher.submit(7, deadline=clock.now() + 1.5))
    await run.wait_started(before + 1)
    clock.advance(1.5)
    assert isinstance(await answered(running), DeadlineExceededError)
    assert hook in observer.calls
    run.release()
    assert await answered(asyncio.ensure_future(batcher.submit(8))) == 80
    assert batcher.accepting
    await batcher.aclose()


class Shutdown(BaseException):
    """Not an ``Exception``: what a library calling ``sys.exit`` in a thread looks like."""


@pytest.mark.parametrize("error", [Shutdown("bye"), SystemExit(3), KeyboardInterrupt()])
async def test_run_batch_raising_a_base_exception_answers_its_batch(error: BaseException) -> None:
    calls = 0

    def run_batch(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error
        return [item * 10 for item in items]

    config = BatchConfig(max_batch_size=4, max_queue_delay_s=0.0)
    batcher: DynamicBatcher[int, int] = DynamicBatcher(run_batch, config, clock=ManualClock())
    batcher.start()
    results = [
        await answered(task)
        for task in [asyncio.ensure_future(batcher.submit(item)) for item in (1, 2, 3)]
    ]
    assert all(isinstance(result, RuntimeError) for result in results), results
    assert type(error).__name__ in str(results[0])
    assert await answered(asyncio.ensure_future(batcher.submit(4))) == 40  # still serving
    await batcher.aclose()


async def test_a_dead_loop_reports_its_failure_once() -> None:
    failures: list[BaseException] = []
    clock = ManualClock()
    batcher: DynamicBatcher[int, int] = DynamicBatcher(
        lambda items: items,
        BatchConfig(max_queue_delay_s=1.0, dispatch_when_idle=False),
        clock=clock,
        on_failure=failures.append,
    )
    batcher.start()
    waiting = asyncio.ensure_future(batcher.submit(1))
    await settle()

    def broken(*args: Any) -> Any:
        raise RuntimeError("bug in the policy")

    batcher._clock = type("Broken", (), {"now": broken, "call_at": broken})()
    batcher._wake.set()
    assert isinstance(await answered(waiting), BatcherClosedError)
    assert [str(failure) for failure in failures] == ["bug in the policy"]
    assert batcher.failure is failures[0]
    await batcher.aclose()


async def test_queued_cost_follows_the_queue() -> None:
    clock = ManualClock()
    run = GatedRun()
    config = BatchConfig(max_batch_size=1, max_inflight_batches=1, max_queue_delay_s=0.0)
    batcher: DynamicBatcher[int, Any] = DynamicBatcher(run, config, clock=clock)
    batcher.start()
    running = asyncio.ensure_future(batcher.submit(1, cost=100))
    await run.wait_started(1)
    assert batcher.queued_cost == 0  # dispatched: no longer waiting
    queued = [asyncio.ensure_future(batcher.submit(item, cost=10 * item)) for item in (2, 3)]
    await settle()
    assert batcher.queued_cost == 50
    queued[0].cancel()
    await settle()
    assert batcher.queued_cost == 30
    run.release()
    assert await answered(running) == 10
    assert await answered(queued[1]) == 30
    assert batcher.queued_cost == 0
    await batcher.aclose()

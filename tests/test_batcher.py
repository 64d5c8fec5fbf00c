"""DynamicBatcher: batch formation, result mapping, isolation, limits, deadlines, drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batching import (
    BatchConfig,
    BatcherClosedError,
    DeadlineExceededError,
    DynamicBatcher,
    ExecutionTimeModel,
    ManualClock,
    QueueFullError,
)
from tests.fakes import GatedRun, Recorder, settle, until

MS = 0.001


def make(
    run: Any,
    clock: ManualClock | None = None,
    *,
    timings: ExecutionTimeModel | None = None,
    **config: Any,
) -> tuple[DynamicBatcher[int, Any], Recorder]:
    config.setdefault("dispatch_when_idle", False)
    config.setdefault("max_queue_delay_s", 2 * MS)
    recorder = Recorder()
    batcher: DynamicBatcher[int, Any] = DynamicBatcher(
        run, BatchConfig(**config), recorder, clock=clock or ManualClock(), timings=timings
    )
    batcher.start()
    return batcher, recorder


def submit_all(batcher: DynamicBatcher[int, Any], items: list[int]) -> list[asyncio.Task[Any]]:
    return [asyncio.ensure_future(batcher.submit(item)) for item in items]


async def test_window_counts_from_the_first_request_of_the_batch() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(run, clock, max_queue_delay_s=2 * MS)
    first = asyncio.ensure_future(batcher.submit(1))
    await settle()
    clock.advance(1.5 * MS)
    second = asyncio.ensure_future(batcher.submit(2))
    await settle()
    clock.advance(0.4 * MS)  # 1.9 ms after the first request: still inside the window
    await settle()
    assert recorder.dispatched == []
    clock.advance(0.1 * MS)  # exactly 2 ms after the first, only 0.5 ms after the second
    await settle()
    assert recorder.dispatched == [2]
    assert recorder.waits == pytest.approx([2 * MS, 0.5 * MS])
    assert await first == 10
    assert await second == 20
    await batcher.aclose()


async def test_full_batch_is_dispatched_without_waiting_for_the_window() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(run, clock, max_batch_size=4, max_queue_delay_s=1.0)
    tasks = submit_all(batcher, list(range(10)))
    await settle()
    # Two full batches leave at once (two execution slots); the rest waits for its window.
    assert recorder.dispatched[:2] == [4, 4]
    clock.advance(1.0)
    await until(lambda: len(recorder.dispatched) == 3)
    assert recorder.dispatched == [4, 4, 2]
    assert [await task for task in tasks] == [item * 10 for item in range(10)]
    assert all(len(batch) <= 4 for batch in run.batches)
    await batcher.aclose()


async def test_lone_request_on_an_idle_batcher_does_not_wait() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(run, clock, dispatch_when_idle=True, max_queue_delay_s=1.0)
    assert await batcher.submit(7) == 70  # the clock never moved: no window was waited
    assert recorder.waits == [0.0]
    await batcher.aclose()


async def test_busy_batcher_still_waits_for_the_window() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(run, clock, dispatch_when_idle=True, max_queue_delay_s=3 * MS)
    first = asyncio.ensure_future(batcher.submit(1))
    await run.wait_started(1)
    later = submit_all(batcher, [2, 3])
    await settle()
    assert recorder.dispatched == [1]  # one batch in flight: the next one collects
    clock.advance(3 * MS)
    await settle()
    assert recorder.dispatched == [1, 2]
    run.release()
    assert await first == 10
    assert [await task for task in later] == [20, 30]
    await batcher.aclose()


async def test_results_reach_their_own_requests_under_concurrency() -> None:
    run = GatedRun(compute=lambda item: f"result-{item}", gated=False)
    # The real clock: many interleaved arrivals and batch completions.
    batcher: DynamicBatcher[int, Any] = DynamicBatcher(
        run, BatchConfig(max_batch_size=7, max_queue_delay_s=0.001)
    )
    batcher.start()

    async def one(item: int) -> None:
        await asyncio.sleep((item % 13) * 0.0003)
        assert await batcher.submit(item) == f"result-{item}"

    await asyncio.gather(*(one(item) for item in range(300)))
    assert sorted(item for batch in run.batches for item in batch) == list(range(300))
    assert max(len(batch) for batch in run.batches) <= 7
    assert len(run.batches) < 300  # requests did share batches
    await batcher.aclose()


async def test_an_item_error_fails_only_its_own_request() -> None:
    def compute(item: int) -> object:
        if item == 3:
            return ValueError("bad item")
        return item * 10

    run = GatedRun(compute=compute, gated=False)
    clock = ManualClock()
    batcher, _ = make(run, clock, max_batch_size=5)
    tasks = submit_all(batcher, [1, 2, 3, 4, 5])
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[:2] == [10, 20]
    assert isinstance(results[2], ValueError)
    assert results[3:] == [40, 50]
    assert len(run.batches) == 1
    await batcher.aclose()


async def test_run_batch_raising_fails_that_batch_only() -> None:
    run = GatedRun(gated=False)
    run.fail_batch = {0}
    clock = ManualClock()
    batcher, recorder = make(run, clock, max_batch_size=2)
    first = await asyncio.gather(*submit_all(batcher, [1, 2]), return_exceptions=True)
    assert all(isinstance(result, RuntimeError) for result in first)
    second = await asyncio.gather(*submit_all(batcher, [3, 4]))
    assert second == [30, 40]
    assert [error is None for _, error in recorder.completed] == [False, True]
    await batcher.aclose()


async def test_wrong_number_of_results_fails_the_batch_clearly() -> None:
    batcher: DynamicBatcher[int, int] = DynamicBatcher(
        lambda items: items[:-1], BatchConfig(max_batch_size=2, dispatch_when_idle=False),
        clock=ManualClock(),
    )  # fmt: skip
    batcher.start()
    results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
    assert all(isinstance(result, RuntimeError) for result in results)
    assert "1 results for 2 items" in str(results[0])
    await batcher.aclose()


async def test_full_queue_rejects_at_once() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(run, clock, max_batch_size=1, max_queue_size=2, max_inflight_batches=1)
    running = asyncio.ensure_future(batcher.submit(0))
    await run.wait_started(1)
    queued = submit_all(batcher, [1, 2])
    await settle()
    assert batcher.queue_depth == 2
    with pytest.raises(QueueFullError) as raised:
        await batcher.submit(3)
    assert raised.value.retry_after_s >= 1
    assert recorder.rejects == ["overloaded"]
    run.release()
    assert await running == 0
    assert [await task for task in queued] == [10, 20]
    await batcher.aclose()


async def test_aclose_drains_accepted_requests_and_refuses_new_ones() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(run, clock, max_batch_size=2, max_queue_delay_s=60.0)
    tasks = submit_all(batcher, [1, 2, 3, 4, 5])
    await run.wait_started(1)
    closing = asyncio.ensure_future(batcher.aclose(drain_timeout=10))
    await settle()
    with pytest.raises(BatcherClosedError):
        await batcher.submit(6)
    assert recorder.rejects == ["closed"]
    run.release()
    await closing
    # Draining dispatched the last, partial batch at once instead of waiting 60 s for it.
    assert [await task for task in tasks] == [10, 20, 30, 40, 50]
    await batcher.aclose()  # idempotent


async def test_drain_timeout_fails_what_is_left() -> None:
    run = GatedRun()
    batcher, _ = make(run, ManualClock(), max_batch_size=1, max_inflight_batches=1)
    tasks = submit_all(batcher, [1, 2])
    await run.wait_started(1)
    await batcher.aclose(drain_timeout=0.05)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, BatcherClosedError) for result in results)
    run.release()


async def test_submit_before_start_is_refused() -> None:
    batcher: DynamicBatcher[int, int] = DynamicBatcher(lambda items: items)
    with pytest.raises(BatcherClosedError, match="not started"):
        await batcher.submit(1)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="preferred batch size 64"):
        BatchConfig(max_batch_size=32, preferred_batch_sizes=(8, 64))
    assert BatchConfig(max_batch_size=24, preferred_batch_sizes=(12, 6)).batch_buckets == (
        1, 2, 4, 6, 8, 12, 16, 24,
    )  # fmt: skip


# -- preferred sizes, deadlines, cancellation, overlap, SLO --------------------------------


async def test_preferred_size_dispatches_the_largest_that_fits_at_once() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(
        run, clock, max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_s=1.0,
        max_inflight_batches=1,
    )  # fmt: skip
    tasks = submit_all(batcher, list(range(3)))
    await settle()
    assert recorder.dispatched == []  # 3 < 4: wait for more or for the window
    tasks += submit_all(batcher, list(range(3, 11)))  # 11 waiting now
    await until(lambda: len(recorder.dispatched) >= 1)
    assert recorder.dispatched[0] == 8
    await until(lambda: len(run.batches) == 1 and run.running == 0)
    await settle()
    assert recorder.dispatched == [8]  # 3 left: below every preferred size
    clock.advance(1.0)
    await until(lambda: len(recorder.dispatched) == 2)
    assert recorder.dispatched == [8, 3]
    assert [await task for task in tasks] == [item * 10 for item in range(11)]
    await batcher.aclose()


async def test_request_past_its_deadline_is_dropped_before_dispatch() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(run, clock, max_queue_delay_s=10 * MS)
    doomed = asyncio.ensure_future(batcher.submit(1, deadline=clock.now() + 3 * MS))
    kept = asyncio.ensure_future(batcher.submit(2, deadline=clock.now() + 50 * MS))
    await settle()
    clock.advance(3 * MS)
    await settle()
    with pytest.raises(DeadlineExceededError) as raised:
        await doomed
    assert not raised.value.dispatched
    assert [reason for reason, _ in recorder.drops] == ["deadline_exceeded"]
    assert recorder.drops[0][1] == pytest.approx(3 * MS)
    clock.advance(7 * MS)
    assert await kept == 20
    assert run.batches == [[2]]  # the expired request was never computed
    await batcher.aclose()


async def test_deadline_passing_while_the_batch_runs_answers_at_once() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(run, clock, dispatch_when_idle=True)
    task = asyncio.ensure_future(batcher.submit(1, deadline=clock.now() + 5 * MS))
    await run.wait_started(1)
    clock.advance(5 * MS)
    with pytest.raises(DeadlineExceededError) as raised:
        await task
    assert raised.value.dispatched
    assert recorder.expired_in_flight == 1
    run.release()
    await until(lambda: len(recorder.completed) == 1)  # the late result is discarded quietly
    await batcher.aclose()


async def test_deadline_already_past_at_submit() -> None:
    clock = ManualClock(start=10.0)
    batcher, recorder = make(GatedRun(), clock)
    with pytest.raises(DeadlineExceededError):
        await batcher.submit(1, deadline=9.0)
    assert recorder.drops == [("deadline_exceeded", 0.0)]
    await batcher.aclose()


async def test_cancelled_request_is_removed_before_dispatch() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, recorder = make(run, clock, max_queue_delay_s=2 * MS)
    tasks = submit_all(batcher, [1, 2, 3])
    await settle()
    tasks[1].cancel()
    await settle()
    assert batcher.queue_depth == 2
    assert recorder.drops == [("cancelled", 0.0)]
    clock.advance(2 * MS)
    assert await tasks[0] == 10
    assert await tasks[2] == 30
    assert run.batches == [[1, 3]]
    await batcher.aclose()


async def test_next_batch_is_formed_while_one_runs_but_never_above_the_limit() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(
        run, clock, max_batch_size=2, max_inflight_batches=2, max_queue_delay_s=0.0
    )
    tasks = submit_all(batcher, list(range(8)))
    await run.wait_started(2)  # the second batch started while the first still runs
    await settle()
    assert recorder.dispatched == [2, 2]
    assert batcher.inflight_batches == 2
    assert batcher.queue_depth == 4  # no third batch while two are in flight
    run.release(0)
    await run.wait_started(3)
    assert run.max_running <= 2
    run.release()
    assert [await task for task in tasks] == [item * 10 for item in range(8)]
    assert run.max_running == 2
    await batcher.aclose()


async def test_serial_execution_gets_only_a_full_batch_ready_ahead() -> None:
    clock = ManualClock()
    run = GatedRun()
    timings = ExecutionTimeModel()
    batcher, recorder = make(
        run, clock, timings=timings, max_batch_size=2, max_inflight_batches=2,
        max_queue_delay_s=0.0, dispatch_when_idle=True, serial_execution=True,
    )  # fmt: skip
    first = asyncio.ensure_future(batcher.submit(1))
    await run.wait_started(1)
    second = asyncio.ensure_future(batcher.submit(2))
    clock.advance(5 * MS)  # its window is long over: still not worth getting ready ahead
    await settle()
    assert recorder.dispatched == [1]
    third = asyncio.ensure_future(batcher.submit(3))
    await run.wait_started(2)  # a full batch is
    assert recorder.dispatched == [1, 2]
    clock.advance(5 * MS)
    run.release(0)
    assert await first == 10
    clock.advance(3 * MS)
    run.release(1)
    assert [await second, await third] == [20, 30]
    # Its own time runs from the end of the batch before it: 3 ms, not the 8 ms since dispatch.
    assert timings.estimate(2) == pytest.approx(3 * MS)
    await batcher.aclose()


async def test_slo_dispatches_early_when_waiting_would_miss_it() -> None:
    clock = ManualClock()
    timings = ExecutionTimeModel()
    timings.observe(1, 6 * MS)
    timings.observe(2, 7 * MS)
    run = GatedRun(gated=False)
    batcher, recorder = make(
        run, clock, timings=timings, latency_slo_s=10 * MS, max_queue_delay_s=8 * MS
    )
    task = asyncio.ensure_future(batcher.submit(1))
    await settle()
    clock.advance(3 * MS)  # 3 + 6 (expected run) = 9 ms: still within the 10 ms SLO
    await settle()
    assert recorder.dispatched == []
    other = asyncio.ensure_future(batcher.submit(2))  # two requests: 7 ms expected
    await settle()
    assert recorder.dispatched == [2]  # 3 + 7 = 10 ms: go now, not at the 8 ms window
    assert await task == 10
    assert await other == 20
    await batcher.aclose()


async def test_a_crashed_loop_fails_waiting_requests_and_stops_accepting() -> None:
    clock = ManualClock()
    run = GatedRun(gated=False)
    batcher, _ = make(run, clock, max_queue_delay_s=1.0)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug in the policy")

    waiting = asyncio.ensure_future(batcher.submit(1))
    await settle()
    batcher._clock = type("Broken", (), {"now": broken, "call_at": broken})()
    batcher._wake.set()
    with pytest.raises(BatcherClosedError, match="loop failed"):
        await waiting
    assert not batcher.accepting
    with pytest.raises(BatcherClosedError):
        await batcher.submit(2)
    await batcher.aclose()


# -- priorities ----------------------------------------------------------------------------


async def test_batches_are_filled_from_the_highest_priority_down() -> None:
    clock = ManualClock()
    run = GatedRun()
    batcher, _ = make(
        run, clock, max_batch_size=2, max_inflight_batches=1, priority_levels=3,
        default_priority=1, dispatch_when_idle=True, max_queue_delay_s=1.0,
    )  # fmt: skip
    first = asyncio.ensure_future(batcher.submit(0))
    await run.wait_started(1)
    low = [asyncio.ensure_future(batcher.submit(item, priority=2)) for item in (1, 2)]
    normal = asyncio.ensure_future(batcher.submit(3))  # the default level
    high = [asyncio.ensure_future(batcher.submit(item, priority=0)) for item in (4, 5, 6)]
    await settle()
    for index in range(3):
        run.release(index)
        await run.wait_started(index + 2)
    run.release()
    # Level 0 first (first come, first served), then level 1, then level 2; the clock never
    # moved: each batch left when the device was free.
    assert run.batches == [[0], [4, 5], [6, 3], [1, 2]]
    assert await first == 0
    assert [await task for task in [*high, normal, *low]] == [40, 50, 60, 30, 10, 20]
    with pytest.raises(ValueError, match="priority must be between 0 and 2"):
        await batcher.submit(7, priority=3)
    await batcher.aclose()


async def test_a_request_that_cannot_finish_in_time_is_not_run() -> None:
    """Under overload, computing answers whose deadline passes mid-batch wastes the device on
    nobody: a request is answered at dispatch when the learned batch time says it is too late."""
    clock = ManualClock()
    run = GatedRun()
    batcher, recorder = make(run, clock, max_batch_size=1, max_inflight_batches=1,
                             dispatch_when_idle=True)  # fmt: skip
    first = asyncio.ensure_future(batcher.submit(1))
    await run.wait_started(1)
    clock.advance(1.0)  # a batch takes 1 s here
    run.release(0)
    assert await first == 10
    hopeless = asyncio.ensure_future(batcher.submit(2, deadline=clock.now() + 0.5))
    with pytest.raises(DeadlineExceededError) as raised:
        await hopeless
    assert not raised.value.dispatched
    assert len(run.batches) == 1  # never computed
    assert [reason for reason, _ in recorder.drops] == ["deadline_exceeded"]
    run.release()
    assert await batcher.submit(3, deadline=clock.now() + 2.0) == 30
    await batcher.aclose()


async def test_a_full_queue_makes_room_for_a_higher_priority() -> None:
    run = GatedRun()
    batcher, recorder = make(
        run, ManualClock(), max_batch_size=1, max_inflight_batches=1, max_queue_size=2,
        priority_levels=3, default_priority=1, dispatch_when_idle=True,
    )  # fmt: skip
    running = asyncio.ensure_future(batcher.submit(0))
    await run.wait_started(1)
    older, newer = (asyncio.ensure_future(batcher.submit(item, priority=2)) for item in (1, 2))
    await settle()
    assert batcher.queue_depth == 2  # full
    high = asyncio.ensure_future(batcher.submit(3, priority=0))
    await settle()
    with pytest.raises(QueueFullError):  # the newest of the lowest level made room
        await newer
    assert batcher.queue_depth == 2
    assert [reason for reason, _ in recorder.drops] == ["displaced"]
    # Nothing waits below the same level: an equal priority is refused, as before.
    with pytest.raises(QueueFullError):
        await batcher.submit(4, priority=2)
    run.release()
    assert [await running, await high, await older] == [0, 30, 10]
    assert run.batches == [[0], [3], [1]]
    await batcher.aclose()


def test_priority_config_is_validated() -> None:
    with pytest.raises(ValueError, match="priority_levels"):
        BatchConfig(priority_levels=0)
    with pytest.raises(ValueError, match="default_priority"):
        BatchConfig(priority_levels=2, default_priority=2)


async def test_answered_requests_are_let_go_behind_a_long_waiting_one() -> None:
    """A request waiting with the earliest deadline keeps the deadline heap's top; the ones
    answered meanwhile must not keep their items alive behind it."""
    import gc
    import threading
    import weakref

    class Image:
        def __init__(self, value: int) -> None:
            self.value = value

    held: list[weakref.ref[Image]] = []
    gate = threading.Event()

    def run(items: list[Image]) -> list[int]:  # keeps nothing, unlike the recording fakes
        if items[0].value < 0:
            gate.wait(30)
        return [item.value for item in items]

    batcher: DynamicBatcher[Any, Any] = DynamicBatcher(
        run, BatchConfig(max_batch_size=1, max_inflight_batches=2, dispatch_when_idle=True),
        clock=ManualClock(),
    )  # fmt: skip
    batcher.start()
    waiter = asyncio.ensure_future(batcher.submit(Image(-1), deadline=100.0))
    await until(lambda: batcher.inflight_batches == 1)  # the top of the heap until it ends
    for index in range(200):
        image = Image(index)
        held.append(weakref.ref(image))
        answer = batcher.submit(image, deadline=200.0)
        del image
        assert await answer == index
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
    assert len(batcher._deadlines) <= 64 + 2
    gate.set()
    assert (await waiter) == -1
    await batcher.aclose()

"""The batcher's Prometheus metrics are exact along every path a request can take."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.metrics import Metrics
from batching import (
    BatchConfig,
    BatcherClosedError,
    DeadlineExceededError,
    DynamicBatcher,
    ManualClock,
    QueueFullError,
)
from tests.fakes import GatedRun, settle, until

ONE = {"model": "m", "version": "1"}


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample of model m version 1 (the ``rejected`` counter has the model alone)."""
    scope = {"model": "m"} if name.startswith("batchserve_rejected") else ONE
    sample = metrics.registry.get_sample_value(name, {**scope, **labels})
    return 0.0 if sample is None else sample


async def test_rejections_drops_batches_and_queue_waits_are_counted_exactly() -> None:
    metrics = Metrics()
    view = metrics.version("m", "1")
    clock = ManualClock()
    run = GatedRun()
    config = BatchConfig(
        max_batch_size=2,
        max_queue_size=3,
        max_inflight_batches=1,
        max_queue_delay_s=0.010,
        dispatch_when_idle=False,
    )
    batcher: DynamicBatcher[int, object] = DynamicBatcher(run, config, view, clock=clock)
    batcher.start()
    view.serving(torch.device("cpu"), "fp32", "torch", "random",
                 lambda: batcher.queue_depth, lambda: batcher.inflight_batches)  # fmt: skip

    first = [asyncio.ensure_future(batcher.submit(item)) for item in (1, 2)]  # full: goes at t=0
    await run.wait_started(1)
    expiring = asyncio.ensure_future(batcher.submit(3, deadline=clock.now() + 0.005))
    cancelled = asyncio.ensure_future(batcher.submit(4))
    last = asyncio.ensure_future(batcher.submit(5))
    await settle()
    assert value(metrics, "batchserve_queue_depth") == 3
    assert value(metrics, "batchserve_inflight_batches") == 1
    with pytest.raises(QueueFullError):
        await batcher.submit(6)

    clock.advance(0.002)
    cancelled.cancel()
    await settle()
    clock.advance(0.003)  # t = 5 ms: the deadline of request 3
    await settle()
    with pytest.raises(DeadlineExceededError):
        await expiring
    run.release(0)
    assert await asyncio.gather(*first) == [10, 20]
    await settle()
    clock.advance(0.005)  # t = 10 ms: the window of request 5 ends
    await run.wait_started(2)
    run.release()
    assert await last == 50
    await until(lambda: value(metrics, "batchserve_batches_total", result="ok") == 2)
    await batcher.aclose()
    with pytest.raises(BatcherClosedError):
        await batcher.submit(7)

    assert value(metrics, "batchserve_rejected_requests_total", reason="overloaded") == 1
    assert value(metrics, "batchserve_rejected_requests_total", reason="closed") == 1
    assert value(metrics, "batchserve_dropped_requests_total", reason="cancelled") == 1
    assert value(metrics, "batchserve_dropped_requests_total", reason="deadline_exceeded") == 1
    assert value(metrics, "batchserve_batch_size_count") == 2
    assert value(metrics, "batchserve_batch_size_sum") == 3
    # Queue waits of the three dispatched requests only (0, 0 and 10 ms): the two dropped ones
    # (after 2 and 5 ms) are in batchserve_dropped_requests_total, not in the wait histogram.
    assert value(metrics, "batchserve_queue_wait_seconds_count") == 3
    assert value(metrics, "batchserve_queue_wait_seconds_sum") == pytest.approx(0.010)
    assert value(metrics, "batchserve_queue_depth") == 0

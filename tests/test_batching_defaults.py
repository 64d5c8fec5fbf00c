"""How the batcher behaves with the settings' defaults on a CPU, where it matters most.

``DISPATCH_WHEN_IDLE=true`` and serial execution: an idle device gains nothing from waiting,
so everything waiting leaves at once (up to the cap); while a batch runs, the second slot only
takes a full batch, to get it ready ahead. The window, preferred sizes and the latency SLO
never delay a batch in this configuration; they act only while a batch runs and a slot is
free on a device that runs batches side by side (CUDA), or with ``DISPATCH_WHEN_IDLE=false``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.settings import load_settings
from batching import BatchConfig, DynamicBatcher, ManualClock
from tests.fakes import GatedRun, Recorder, settle


def started(
    config: BatchConfig,
) -> tuple[DynamicBatcher[int, Any], GatedRun, Recorder, ManualClock]:
    clock, run, recorder = ManualClock(), GatedRun(), Recorder()
    batcher: DynamicBatcher[int, Any] = DynamicBatcher(run, config, recorder, clock=clock)
    batcher.start()
    return batcher, run, recorder, clock


@pytest.mark.parametrize(
    "overrides",
    [{}, {"preferred_batch_sizes": "4", "latency_slo_ms": 5000, "max_queue_delay_ms": 1000}],
    ids=["defaults", "with-window-preferred-sizes-and-slo"],
)
async def test_on_a_cpu_batches_leave_when_the_device_is_free(overrides: dict[str, Any]) -> None:
    config = load_settings(max_batch_size=8, **overrides).own_model().batch_config("cpu")
    assert (config.max_inflight_batches, config.dispatch_when_idle) == (2, True)
    assert config.serial_execution
    batcher, run, recorder, clock = started(config)

    first = asyncio.ensure_future(batcher.submit(1))
    await run.wait_started(1)  # an idle device: sent at once
    second = asyncio.ensure_future(batcher.submit(2))
    await settle()
    assert recorder.dispatched == [1]  # the device is busy: a partial batch waits, window or not
    waiting = [second, *(asyncio.ensure_future(batcher.submit(item)) for item in range(3, 13))]
    await run.wait_started(2)
    assert recorder.dispatched == [1, 8]  # a full one is got ready ahead
    run.release(0)
    await settle()
    assert recorder.dispatched == [1, 8]  # the 3 left wait for the device, not for a window
    run.release(1)
    await run.wait_started(3)
    assert recorder.dispatched == [1, 8, 3]  # 3 < the preferred 4: it went all the same
    assert clock.now() == 0  # no timer ever had to fire
    run.release()
    assert await first == 10
    assert [await task for task in waiting] == [item * 10 for item in range(2, 13)]
    await batcher.aclose()


async def test_with_a_free_slot_the_window_does_act() -> None:
    config = load_settings(max_batch_size=8, max_queue_delay_ms=10).own_model().batch_config("cuda")
    batcher, run, recorder, clock = started(config)
    first = asyncio.ensure_future(batcher.submit(1))
    await run.wait_started(1)
    others = [asyncio.ensure_future(batcher.submit(item)) for item in (2, 3)]
    await settle()
    assert recorder.dispatched == [1]  # a slot is free, but the window has not ended
    clock.advance(0.010)
    await run.wait_started(2)
    assert recorder.dispatched == [1, 2]
    run.release()
    assert [await task for task in [first, *others]] == [10, 20, 30]
    await batcher.aclose()

"""Property-based tests: random arrivals, deadlines, cancellations, failures and batch times.

A manual clock drives the batcher in steps; batches "run" for a drawn number of steps. After
each scenario we check the invariants every configuration must keep:

- every request resolves exactly once, with its own result or its own error;
- no batch exceeds ``max_batch_size``, and no request is computed twice;
- cancelled or expired requests are never dispatched after they left;
- no request waits past its window plus the time during which every slot was busy;
- the observer's accounting adds up.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching import (
    BatchConfig,
    DeadlineExceededError,
    DynamicBatcher,
    ExecutionTimeModel,
    ManualClock,
)
from tests.fakes import Recorder, settle, until

STEP = 0.001  # the clock moves in 1 ms steps
EXAMPLES = int(os.environ.get("BATCHSERVE_PROPERTY_EXAMPLES", "200"))


@dataclass(frozen=True)
class Arrival:
    gap_steps: int  # steps after the previous arrival
    deadline_steps: int | None  # relative to arrival
    cancel_steps: int | None  # relative to arrival
    fails: bool  # run_batch returns an exception for this item


arrivals = st.lists(
    st.builds(
        Arrival,
        gap_steps=st.integers(0, 4),
        deadline_steps=st.none() | st.integers(1, 20),
        cancel_steps=st.none() | st.integers(0, 8),
        fails=st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@st.composite
def configs(draw: st.DrawFn) -> BatchConfig:
    cap = draw(st.integers(1, 8))
    preferred = draw(st.lists(st.integers(1, cap), max_size=3, unique=True))
    return BatchConfig(
        max_batch_size=cap,
        max_queue_delay_s=draw(st.integers(0, 6)) * STEP,
        preferred_batch_sizes=tuple(preferred),
        max_queue_size=1000,
        max_inflight_batches=draw(st.integers(1, 3)),
        latency_slo_s=draw(st.none() | st.integers(2, 20).map(lambda steps: steps * STEP)),
        dispatch_when_idle=draw(st.booleans()),
    )


@dataclass
class FakeDevice:
    """``run_batch`` that records its items and blocks until the driver ends the batch."""

    clock: ManualClock
    durations: list[int]
    fails: set[int]
    lock: threading.Lock = field(default_factory=threading.Lock)
    batches: list[tuple[float, list[int]]] = field(default_factory=list)
    gates: list[threading.Event] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def __call__(self, items: list[int]) -> list[object]:
        with self.lock:
            index = len(self.batches)
            started = self.clock.now()  # the clock only moves while no thread is starting
            self.batches.append((started, list(items)))
            duration = self.durations[index % len(self.durations)]
            self.ends.append(started + duration * STEP)
            gate = threading.Event()
            self.gates.append(gate)
        if not gate.wait(timeout=30):
            raise TimeoutError("batch never released")
        return [ValueError(f"item {item}") if item in self.fails else item * 10 for item in items]


async def run_scenario(config: BatchConfig, plan: list[Arrival], durations: list[int]) -> None:
    clock = ManualClock()
    fails = {index for index, arrival in enumerate(plan) if arrival.fails}
    device = FakeDevice(clock, durations, fails)
    recorder = Recorder()
    timings = ExecutionTimeModel()
    timings.observe(1, durations[0] * STEP)
    batcher: DynamicBatcher[int, object] = DynamicBatcher(
        device, config, recorder, clock=clock, timings=timings
    )
    batcher.start()

    arrival_at: dict[int, float] = {}
    schedule: list[tuple[int, int]] = []  # (step, index)
    step = 0
    for index, arrival in enumerate(plan):
        step += arrival.gap_steps
        schedule.append((step, index))
    tasks: dict[int, asyncio.Task[object]] = {}
    cancel_at: dict[int, int] = {}
    cancelled_at: dict[int, float] = {}
    released = 0
    busy_steps: list[tuple[float, bool]] = []  # (time, every slot busy during the next step)

    async def stabilise() -> None:
        """Run until the batcher has dispatched what it will and due batches have ended."""
        nonlocal released
        while True:
            await settle()
            await until(lambda: len(device.batches) == len(recorder.dispatched))
            due = [
                gate
                for index, gate in enumerate(device.gates)
                if not gate.is_set() and device.ends[index] <= clock.now()
            ]
            if not due:
                return
            for gate in due:
                gate.set()
            released += len(due)
            expected = released
            await until(lambda: len(recorder.completed) == expected)  # noqa: B023

    last_step = (schedule[-1][0] if schedule else 0) + 200
    pending = list(schedule)
    for now_step in range(last_step):
        while pending and pending[0][0] == now_step:
            _, index = pending.pop(0)
            arrival = plan[index]
            deadline = None
            if arrival.deadline_steps is not None:
                deadline = clock.now() + arrival.deadline_steps * STEP
            arrival_at[index] = clock.now()
            tasks[index] = asyncio.ensure_future(batcher.submit(index, deadline))
            if arrival.cancel_steps is not None:
                cancel_at[index] = now_step + arrival.cancel_steps
        await settle()  # let new submits reach the queue before anything is cancelled
        for index, when in list(cancel_at.items()):
            if when == now_step and not tasks[index].done():
                tasks[index].cancel()
                cancelled_at[index] = clock.now()
                del cancel_at[index]
        await stabilise()
        busy_steps.append((clock.now(), batcher.inflight_batches >= config.max_inflight_batches))
        if not pending and all(task.done() for task in tasks.values()):
            break
        clock.advance(STEP)

    for gate in device.gates:
        gate.set()
    outcomes = await asyncio.wait_for(
        asyncio.gather(*tasks.values(), return_exceptions=True), timeout=5
    )
    await batcher.aclose(drain_timeout=5)

    # -- invariants -------------------------------------------------------------------------
    computed: dict[int, float] = {}
    for started, items in device.batches:
        assert 1 <= len(items) <= config.max_batch_size
        for item in items:
            assert item not in computed, f"request {item} was computed twice"
            computed[item] = started

    for index, outcome in zip(tasks, outcomes, strict=True):
        if index in computed:
            dispatched = computed[index]
            assert dispatched >= arrival_at[index]
            if index in cancelled_at:
                assert cancelled_at[index] >= dispatched, "dispatched after it was cancelled"
            deadline_steps = plan[index].deadline_steps
            if deadline_steps is not None:
                assert dispatched < arrival_at[index] + deadline_steps * STEP + 1e-9
            busy = sum(
                STEP
                for at, all_busy in busy_steps
                if all_busy and arrival_at[index] - 1e-9 <= at < dispatched - 1e-9
            )
            waited = dispatched - arrival_at[index]
            assert waited <= config.max_queue_delay_s + busy + STEP + 1e-9, (
                f"request {index} waited {waited * 1000:.0f} ms (window "
                f"{config.max_queue_delay_s * 1000:.0f} ms, busy {busy * 1000:.0f} ms)"
            )
        if isinstance(outcome, asyncio.CancelledError):
            assert index in cancelled_at
        elif isinstance(outcome, DeadlineExceededError):
            assert plan[index].deadline_steps is not None
        elif isinstance(outcome, ValueError):
            assert index in fails
            assert str(outcome) == f"item {index}"
            assert index in computed
        else:
            assert outcome == index * 10, "a result reached the wrong request"
            assert index in computed
            assert index not in fails

    dropped = len(recorder.drops)
    assert sum(recorder.dispatched) == len(computed)
    assert dropped + len(computed) == len(tasks)  # each request left the queue exactly once
    assert recorder.rejects == []


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(config=configs(), plan=arrivals, durations=st.lists(st.integers(0, 8), min_size=1))
def test_batcher_invariants(config: BatchConfig, plan: list[Arrival], durations: list[int]) -> None:
    asyncio.run(run_scenario(config, plan, durations))

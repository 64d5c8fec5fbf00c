"""The dispatch rule, as a pure function, and the execution-time model behind the SLO."""

from __future__ import annotations

import pytest

from batching import BatchConfig, ExecutionTimeModel
from batching.policy import Decision, decide

MS = 0.001


def rule(config: BatchConfig, *, now: float = 0.0, waiting: int = 1, oldest: float = 0.0,
         inflight: int = 1, closing: bool = False,
         estimate: dict[int, float] | None = None) -> Decision:  # fmt: skip
    table = estimate or {}
    return decide(
        config,
        now=now,
        waiting=waiting,
        oldest_arrival=oldest,
        inflight=inflight,
        closing=closing,
        estimate=table.get,
    )


def test_waits_for_the_window_then_dispatches_what_is_there() -> None:
    config = BatchConfig(max_batch_size=8, max_queue_delay_s=2 * MS)
    waiting = rule(config, now=1 * MS, waiting=3)
    assert waiting == Decision(0, wake_at=2 * MS, wake_count=8)
    assert rule(config, now=2 * MS, waiting=3) == Decision(3)


def test_full_batch_goes_at_once() -> None:
    config = BatchConfig(max_batch_size=8, max_queue_delay_s=1.0)
    assert rule(config, waiting=8) == Decision(8)
    assert rule(config, waiting=20) == Decision(8)


def test_idle_device_takes_whatever_waits() -> None:
    config = BatchConfig(max_batch_size=8, max_queue_delay_s=1.0)
    assert rule(config, waiting=3, inflight=0) == Decision(3)
    strict = BatchConfig(max_batch_size=8, max_queue_delay_s=1.0, dispatch_when_idle=False)
    assert rule(strict, waiting=3, inflight=0).size == 0


def test_preferred_sizes() -> None:
    config = BatchConfig(max_batch_size=32, max_queue_delay_s=1.0, preferred_batch_sizes=(8, 16))
    assert rule(config, waiting=7) == Decision(0, wake_at=1.0, wake_count=8)
    assert rule(config, waiting=9) == Decision(8)
    assert rule(config, waiting=17).size == 16
    assert rule(config, waiting=12, now=1.0).size == 8  # preferred size first, rest later


def test_closing_dispatches_without_waiting() -> None:
    config = BatchConfig(max_batch_size=8, max_queue_delay_s=1.0)
    assert rule(config, waiting=2, closing=True) == Decision(2)


def test_slo_brings_dispatch_forward_and_watches_every_arrival() -> None:
    config = BatchConfig(max_batch_size=8, max_queue_delay_s=5 * MS, latency_slo_s=10 * MS)
    times = {1: 4 * MS, 2: 7 * MS}
    assert rule(config, waiting=1, estimate=times) == Decision(0, wake_at=5 * MS, wake_count=2)
    early = rule(config, waiting=2, estimate=times)
    assert early.wake_at == pytest.approx(3 * MS)
    assert rule(config, waiting=2, now=3 * MS, estimate=times).size == 2
    # Nothing learned yet: the window alone decides.
    assert rule(config, waiting=2).wake_at == 5 * MS


def test_execution_time_model() -> None:
    model = ExecutionTimeModel(smoothing=0.5)
    assert model.estimate(4) is None
    model.observe(4, 0.040)
    assert model.estimate(4) == pytest.approx(0.040)
    assert model.estimate(8) == pytest.approx(0.080)  # one point: proportional
    model.observe(4, 0.060)
    assert model.estimate(4) == pytest.approx(0.050)  # smoothed
    model.observe(8, 0.070)
    # Line through (4, 50 ms) and (8, 70 ms): 5 ms per item + 30 ms.
    assert model.estimate(16) == pytest.approx(0.110)
    assert model.estimate(1) == pytest.approx(0.035)
    with pytest.raises(ValueError, match="smoothing"):
        ExecutionTimeModel(smoothing=0)

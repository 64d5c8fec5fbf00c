"""When to dispatch: a pure function of the queue's state, so the rule is easy to test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batching.config import BatchConfig


@dataclass(frozen=True)
class Decision:
    """Dispatch ``size`` requests now, or (``size == 0``) wait.

    While waiting, decide again at ``wake_at`` (None: no timer) or as soon as ``wake_count``
    requests are waiting, whichever comes first.
    """

    size: int
    wake_at: float | None = None
    wake_count: int = 1


def decide(
    config: BatchConfig,
    *,
    now: float,
    waiting: int,
    oldest_arrival: float,
    inflight: int,
    closing: bool,
    estimate: Callable[[int], float | None],
) -> Decision:
    """Decide for a batcher that holds a free execution slot and ``waiting >= 1`` requests."""
    cap = config.max_batch_size
    if waiting >= cap:
        return Decision(cap)
    if config.serial_execution and inflight > 0:
        # Only a full batch is worth getting ready ahead; a finishing batch wakes the batcher.
        return Decision(0, wake_count=cap)
    if closing:
        # Nothing new will arrive: waiting can only add latency.
        return Decision(waiting)
    if config.dispatch_when_idle and inflight == 0:
        return Decision(waiting)
    preferred = [size for size in config.preferred_batch_sizes if size <= waiting]
    if preferred:
        return Decision(preferred[-1])

    dispatch_at = oldest_arrival + config.max_queue_delay_s
    if config.latency_slo_s is not None:
        expected = estimate(waiting)
        if expected is not None:
            # Latest moment at which the oldest request can still finish within the SLO.
            dispatch_at = min(dispatch_at, oldest_arrival + config.latency_slo_s - expected)
    if now >= dispatch_at:
        return Decision(waiting)

    if config.latency_slo_s is not None:
        # Every arrival makes the expected execution longer, so it can bring dispatch forward.
        wake_count = waiting + 1
    else:
        larger = [size for size in config.preferred_batch_sizes if size > waiting]
        wake_count = larger[0] if larger else cap
    return Decision(0, wake_at=dispatch_at, wake_count=wake_count)

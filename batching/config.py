"""Batch formation settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchConfig:
    """How requests are grouped into batches.

    ``max_queue_delay_s`` is the window, counted from the arrival of a batch's first request.
    ``preferred_batch_sizes`` dispatch at once when enough requests wait for one of them.
    ``latency_slo_s`` dispatches early when waiting longer would make the oldest request's
    latency (queue wait plus the learned execution time) exceed it.
    ``dispatch_when_idle`` sends a request at once when no batch is in flight: an idle device
    gains nothing from waiting, so a lone request never pays the window.
    ``priority_levels``: requests carry a level from 0 (served first) to ``priority_levels - 1``
    (``default_priority`` when they say nothing); a batch is filled from level 0 down, first
    come first served within a level. There is no starvation guard: under sustained overload
    of a higher level, lower levels wait (and meet their deadlines).
    ``serial_execution``: the device runs one batch at a time (a CPU), so a second batch in
    flight only gets ready ahead (normalised into its input while the first computes). It is
    dispatched only when full, so it never takes requests that the next batch, formed when the
    device is free, would have carried; its execution time counts from the end of the batch
    before it.
    """

    max_batch_size: int = 32
    max_queue_delay_s: float = 0.002
    preferred_batch_sizes: tuple[int, ...] = field(default_factory=tuple)
    max_queue_size: int = 1024
    max_inflight_batches: int = 2
    latency_slo_s: float | None = None
    dispatch_when_idle: bool = True
    priority_levels: int = 1
    default_priority: int = 0
    serial_execution: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_queue_delay_s < 0:
            raise ValueError("max_queue_delay_s must be >= 0")
        if self.max_queue_size < 1:
            raise ValueError("max_queue_size must be >= 1")
        if self.max_inflight_batches < 1:
            raise ValueError("max_inflight_batches must be >= 1")
        if self.latency_slo_s is not None and self.latency_slo_s <= 0:
            raise ValueError("latency_slo_s must be > 0")
        if self.priority_levels < 1:
            raise ValueError("priority_levels must be >= 1")
        if not 0 <= self.default_priority < self.priority_levels:
            raise ValueError(
                f"default_priority must be between 0 and priority_levels - 1 "
                f"({self.priority_levels - 1})"
            )
        sizes = tuple(sorted(set(self.preferred_batch_sizes)))
        for size in sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred batch size {size} must be between 1 and max_batch_size "
                    f"({self.max_batch_size})"
                )
        object.__setattr__(self, "preferred_batch_sizes", sizes)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """The batch sizes worth preparing for: preferred sizes, powers of two, the cap."""
        sizes = set(self.preferred_batch_sizes)
        size = 1
        while size < self.max_batch_size:
            sizes.add(size)
            size *= 2
        sizes.add(self.max_batch_size)
        return tuple(sorted(sizes))


def parse_sizes(value: str | Sequence[int]) -> tuple[int, ...]:
    """``"8, 16"`` or ``[8, 16]`` -> ``(8, 16)``."""
    if isinstance(value, str):
        return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    return tuple(int(part) for part in value)

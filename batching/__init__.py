"""Dynamic batching for asyncio services. Knows nothing of HTTP or of any ML framework."""

from __future__ import annotations

from batching.batcher import DynamicBatcher, RunBatch
from batching.clock import Clock, LoopClock, ManualClock
from batching.config import BatchConfig, parse_sizes
from batching.errors import (
    BatcherClosedError,
    BatchingError,
    DeadlineExceededError,
    QueueFullError,
)
from batching.observer import BatchObserver
from batching.timing import ExecutionTimeModel

__all__ = [
    "BatchConfig",
    "BatchObserver",
    "BatcherClosedError",
    "BatchingError",
    "Clock",
    "DeadlineExceededError",
    "DynamicBatcher",
    "ExecutionTimeModel",
    "LoopClock",
    "ManualClock",
    "QueueFullError",
    "RunBatch",
    "parse_sizes",
]

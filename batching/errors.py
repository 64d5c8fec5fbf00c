"""Errors raised by the batcher to the callers of ``submit``."""

from __future__ import annotations


class BatchingError(Exception):
    """Base class of every error the batcher raises on its own account."""


class QueueFullError(BatchingError):
    """The queue already holds ``max_queue_size`` waiting requests."""

    def __init__(self, max_queue_size: int, retry_after_s: float) -> None:
        super().__init__(f"the batch queue is full ({max_queue_size} requests waiting)")
        self.max_queue_size = max_queue_size
        self.retry_after_s = retry_after_s


class DeadlineExceededError(BatchingError):
    """The request's deadline passed before its result was ready."""

    def __init__(self, *, dispatched: bool) -> None:
        where = "while its batch was running" if dispatched else "before it was dispatched"
        super().__init__(f"the request deadline passed {where}")
        self.dispatched = dispatched


class BatcherClosedError(BatchingError):
    """The batcher is draining, closed, or its loop failed: it takes no new work."""

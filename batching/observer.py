"""Hooks through which the batcher reports what it does, without knowing who listens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

DropReason = Literal["cancelled", "deadline_exceeded", "displaced"]
RejectReason = Literal["overloaded", "closed"]


class BatchObserver:
    """Receives batcher events. Subclass and override what you need; every hook is a no-op.

    Hooks run on the event loop and must be cheap: they are called for every request.
    """

    def on_reject(self, reason: RejectReason) -> None:
        """``submit`` refused a request at once (queue full, or draining/closed)."""

    def on_drop(self, reason: DropReason, queue_wait_s: float) -> None:
        """A request left the queue without being dispatched (``displaced``: a request of a
        higher priority took its place in a full queue)."""

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        """A batch was handed to ``run_batch``; one queue wait per request."""

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        """``run_batch`` returned (``error`` is None) or raised for the whole batch."""

    def on_expired_in_flight(self) -> None:
        """A request's deadline passed while its batch was running; its result is discarded."""

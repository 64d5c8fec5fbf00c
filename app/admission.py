"""Admission control: bound what admitted, not yet dispatched requests hold, in count and bytes.

A request is admitted before its body is read. From then until its batch is dispatched it
holds memory: its encoded bytes while it is read and decoded, and, when the device decodes
it, until dispatch. ``MAX_QUEUE_SIZE`` bounds how many such requests exist and
``MAX_QUEUE_BYTES`` how many encoded bytes they hold together; past either, the answer is 503
``overloaded`` with ``Retry-After``, at once, before anything more is read.
"""

from __future__ import annotations

import math
from typing import Protocol

from app.errors import OverloadedError


class QueueState(Protocol):
    """What admission reads from the batcher."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def queued_cost(self) -> int: ...

    def retry_after_s(self) -> float: ...


class Admission:
    """Counts requests being read or decoded (``preparing``) and the bytes they hold; the
    batcher counts the rest (``queue_depth`` and ``queued_cost``) until dispatch."""

    def __init__(self, queue: QueueState, max_requests: int, max_bytes: int) -> None:
        self._queue = queue
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.preparing = 0
        self.preparing_bytes = 0

    @property
    def requests(self) -> int:
        """Admitted requests not yet dispatched."""
        return self.preparing + self._queue.queue_depth

    @property
    def bytes(self) -> int:
        """Encoded bytes those requests hold."""
        return self.preparing_bytes + self._queue.queued_cost

    def admit(self, declared_bytes: int = 0) -> Ticket:
        """A ticket for one more request that will read ``declared_bytes`` (its
        ``Content-Length``, when it has one), or ``OverloadedError``."""
        if self.requests >= self.max_requests:
            raise self.overloaded(f"{self.requests} requests are already waiting")
        ticket = Ticket(self)
        try:
            ticket.reserve(declared_bytes)
        except OverloadedError:
            ticket.close()
            raise
        return ticket

    def overloaded(self, why: str) -> OverloadedError:
        retry = max(1, math.ceil(self._queue.retry_after_s()))
        return OverloadedError(
            f"the server is at capacity ({why}); retry later",
            headers={"Retry-After": str(retry)},
        )


class Ticket:
    """One admitted request's share: counted from ``admit`` until ``close`` (idempotent)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.reserved = 0
        self._open = True
        admission.preparing += 1

    def reserve(self, total_bytes: int) -> None:
        """Make sure ``total_bytes`` are counted for this request (they only ever grow while it
        is read); ``OverloadedError`` when they do not fit."""
        extra = total_bytes - self.reserved
        if extra <= 0 or not self._open:
            return
        admission = self._admission
        if admission.bytes + extra > admission.max_bytes:
            raise admission.overloaded(
                f"admitted requests already hold {admission.bytes} of {admission.max_bytes} bytes"
            )
        admission.preparing_bytes += extra
        self.reserved = total_bytes

    def close(self) -> None:
        """Stop counting this request here (it failed, or it is handed to the batcher, which
        counts what it still holds from then on)."""
        if self._open:
            self._open = False
            self._admission.preparing -= 1
            self._admission.preparing_bytes -= self.reserved

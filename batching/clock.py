"""Time sources for the batcher: the event loop's clock, or a manual one for exact tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the batcher needs from time: the current time and a timer."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable: ...


class LoopClock:
    """The running event loop's monotonic clock (``loop.time()`` and ``loop.call_at``)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        return self._running().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        return self._running().call_at(when, callback)

    def _running(self) -> asyncio.AbstractEventLoop:
        # The batcher reads the clock several times per request, and on CPython 3.11
        # get_running_loop() is a getpid() system call each time: the first loop is kept,
        # and a closed one (a test's earlier loop) is looked up again.
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop


class _ManualTimer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to, so window and deadline tests are exact.

    ``advance`` fires every timer that falls due, in order, synchronously; the test then
    yields to the event loop to let the batcher react.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancellable:
        timer = _ManualTimer(callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time only moves forward")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                timer.callback()
        self._now = target

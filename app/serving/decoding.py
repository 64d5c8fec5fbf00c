"""Decoding in priority order: the decode threads take the most urgent waiting work first.

A plain thread pool runs its jobs in arrival order, so a request of many images at priority 3
would hold every decode thread while a priority-1 image waits behind it. Here at most
``workers`` jobs run at once; the others wait in a heap by (priority level, arrival) and the
next free thread goes to the first of them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import TypeVar

from batching.threads import LoopThreads

Result = TypeVar("Result")


class PriorityPool:
    """Runs functions in ``threads``, one per thread at a time, the lowest level first."""

    def __init__(self, threads: LoopThreads) -> None:
        self._threads = threads
        self._free = threads.workers
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, turn in self._waiting if not turn.done())

    async def run(self, level: int, function: Callable[..., Result], *args: object) -> Result:
        """``function(*args)`` in a thread, once a thread is free and no more urgent job (a
        lower ``level``, or the same level earlier) waits."""
        await self._turn(level)
        try:
            return await self._threads.run(function, *args)
        finally:
            self._hand_over()

    async def _turn(self, level: int) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (level, next(self._order), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a thread just as it was cancelled
                self._hand_over()
            raise

    def _hand_over(self) -> None:
        """A thread is free: give it to the first job still waiting, else keep it."""
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

"""How many ``ModelInfer`` messages are received at once.

gRPC reads a whole message before the handler sees it, so it cannot be counted against
``MAX_QUEUE_BYTES`` while it arrives, as an HTTP body is. A call therefore asks for one of a
few receive slots before its message is read, and gives it back once admission counts the
message (or refuses it): however many calls arrive together, the messages being received hold
at most a quarter of ``MAX_QUEUE_BYTES`` (at least one message) beside what admission bounds.
A call waiting for a slot holds only what HTTP/2's flow control lets its client send ahead.
"""

from __future__ import annotations

import asyncio

from app.settings import Settings

# Of MAX_QUEUE_BYTES, the share messages being received may hold.
RECEIVING_SHARE = 4


def receive_slots(settings: Settings, message_limit: int) -> int:
    """Messages of up to ``message_limit`` bytes received at once."""
    return max(1, settings.max_queue_bytes // (RECEIVING_SHARE * message_limit))


class ReceiveSlots:
    """At most ``count`` messages received at once; the others wait their turn in order."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._semaphore = asyncio.Semaphore(count)

    async def take(self) -> Slot:
        """A slot, once one is free (a call cancelled while it waits holds none)."""
        await self._semaphore.acquire()
        return Slot(self._semaphore)


class Slot:
    """One message's turn to be received, given back once (``release`` is idempotent)."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore = semaphore
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._semaphore.release()

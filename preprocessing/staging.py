"""Reusable host buffers: a small ring, one slot per batch in flight, pinned on CUDA."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An empty host tensor, page-locked when ``pinned`` (so copies can be asynchronous)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


class PinnedStaging(Generic[T]):
    """A ring of ``size`` slots, each a set of buffers made once by ``make_slot(index)``.

    A batch acquires a slot for its whole life (staging its inputs, receiving its outputs) and
    releases it when its results have been read, so no buffer is written while a copy from it
    may still be in flight, and nothing is allocated per request. ``acquire`` blocks while all
    slots are taken (which the batcher's in-flight limit prevents when ``size`` matches it).
    """

    def __init__(self, make_slot: Callable[[int], T], size: int) -> None:
        if size < 1:
            raise ValueError("a staging ring needs at least one slot")
        self._slots = [make_slot(index) for index in range(size)]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._taken: set[int] = set()
        self._lock = threading.Lock()
        for index in range(size):
            self._free.put(index)

    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def slots(self) -> tuple[T, ...]:
        """Every slot, taken or free."""
        return tuple(self._slots)

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._slots) - len(self._taken)

    def acquire(self, timeout: float | None = None) -> T:
        try:
            index = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no staging slot became free") from None
        with self._lock:
            self._taken.add(index)
        return self._slots[index]

    def release(self, slot: T) -> None:
        index = next((i for i, candidate in enumerate(self._slots) if candidate is slot), None)
        if index is None:
            raise ValueError("this slot does not belong to the ring")
        with self._lock:
            if index not in self._taken:
                raise ValueError("this slot was released twice")
            self._taken.remove(index)
        self._free.put(index)

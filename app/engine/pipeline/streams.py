"""Streams and timeline marks: CUDA streams and events on a GPU, plain host time on a CPU.

The engine writes one pipeline against this small interface; only the two classes below
know whether a GPU is there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

import torch


class Mark(Protocol):
    """A point on the device's timeline."""

    def synchronize(self) -> None: ...

    def seconds_since(self, earlier: Mark) -> float: ...


class HostMark:
    """On a CPU, work is synchronous: the host clock is the device's clock."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def seconds_since(self, earlier: Mark) -> float:
        assert isinstance(earlier, HostMark)
        return self.at - earlier.at


class CudaMark:
    """A CUDA event recorded on the current stream; read only after ``synchronize``."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.event.record()

    def synchronize(self) -> None:
        self.event.synchronize()  # waits for this event only, never the whole device

    def seconds_since(self, earlier: Mark) -> float:
        assert isinstance(earlier, CudaMark)
        milliseconds: float = earlier.event.elapsed_time(self.event)
        return milliseconds / 1000


class Streams:
    """No streams: the CPU runs everything in order on the calling thread."""

    timed_on_device = False

    def new_copy_stream(self) -> torch.cuda.Stream | None:
        """A stream of its own for one batch slot's preprocessing (None on a CPU)."""
        return None

    def mark(self) -> Mark:
        return HostMark()

    @contextlib.contextmanager
    def preprocess(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def compute(self, after: Mark) -> Iterator[None]:
        yield

    def settle(self, stream: torch.cuda.Stream | None) -> None:
        """Wait until a slot's work and the compute stream are idle (after a failed batch)."""


class CudaStreams(Streams):
    """One copy/preprocess stream per batch slot, one compute stream, ordered by events.

    Batch N+1's decode, host-to-device copies and normalisation run on its slot's stream while
    batch N's forward pass runs on the compute stream; the compute stream waits for the event
    that closes its batch's preprocessing, not for the whole device.

    A stream per slot, not one shared copy stream, because the caching allocator reuses a freed
    block for the next allocation on the same stream as soon as the host frees it. With one
    shared stream, a temporary freed by batch N's resize (still queued on the GPU) could be
    handed to batch N+1's nvjpeg output, which nvjpeg writes on its own internal stream, not
    ordered after batch N's work. With a stream per slot, a block is only reused by the next
    batch of the same slot, which starts after this batch's done event has completed.
    """

    timed_on_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def new_copy_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def mark(self) -> Mark:
        return CudaMark()

    @contextlib.contextmanager
    def preprocess(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        assert stream is not None
        with torch.cuda.stream(stream):
            yield

    @contextlib.contextmanager
    def compute(self, after: Mark) -> Iterator[None]:
        assert isinstance(after, CudaMark)
        self.compute_stream.wait_event(after.event)
        with torch.cuda.stream(self.compute_stream):
            yield

    def settle(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            stream.synchronize()
        self.compute_stream.synchronize()


def streams_for(device: torch.device) -> Streams:
    return CudaStreams(device) if device.type == "cuda" else Streams()

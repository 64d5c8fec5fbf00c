"""A batch split across the CPU's cores: its pieces run side by side, each thread on its share
of the threads, instead of every operation of the whole batch split over all of them.

On a few cores, a small model's operations (a mobile network's depthwise convolutions, a
detector's decoding in PyTorch) are too short to split well: two threads on one forward pass
wait for each other at every layer. Run as pieces of a batch on one thread each, the same work
has nothing to wait for: on a 2-core AMD EPYC, SSDlite on ONNX Runtime, with its decoding,
took 8.72 ms an image that way against 10.3 as one batch over both threads and 12.4 alone
(``benchmarks/studies/shards/``). A batch smaller than the parts still runs whole, on every
thread, so that one image alone keeps the latency of an unbatched forward pass.

``ShardedBackend`` wraps two openings of the same model: ``whole`` (every thread, for small
batches) and ``part`` (safe to call from several threads at once, each call on
``threads_each`` threads: a second ONNX Runtime session, an OpenVINO model compiled with one
stream per part, or PyTorch's own module, whose threads are the calling thread's). ``shards``
threads (the batch's own and a pool's) take the batch's pieces in turn, twice as many pieces
as threads; each piece's output is the model's (decoded, for a detector on a runtime) and the
pieces are joined in order: tensors concatenated, a detector's padded ``(boxes, scores,
labels)`` padded to the widest piece first (a score of 0 pads), lists of per-image answers
chained.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.functional import pad

from app.engine.backends.base import Backend, ImageSizes

# Pieces of a batch per thread: a thread that other work slows down (a request's decoding, the
# event loop) leaves more of them to the others instead of holding the whole batch back.
PIECES_PER_THREAD = 2


class ShardedBackend(Backend):
    """``whole``'s model run as ``shards`` parts of each batch side by side (``part``, each
    call on ``threads_each`` threads); batches of fewer rows than parts run ``whole``."""

    def __init__(self, whole: Backend, part: Backend, shards: int, threads_each: int) -> None:
        if shards < 2:
            raise ValueError("a batch is split into two parts at least")
        self.whole, self.part = whole, part
        self.shards, self.threads_each = shards, threads_each
        self.name = whole.name
        self.device = whole.device
        self.input_dtype = whole.input_dtype
        self.channels_last = whole.channels_last
        self.precision = whole.precision
        self.fixed_shapes = False
        self.serialized = True  # one batch at a time: its parts take every core
        self.decode, self.box_head = whole.decode, whole.box_head
        self.path = getattr(whole, "path", None)
        self.measured_rates = whole.measured_rates
        self.rejected_precisions = whole.rejected_precisions
        self.int8_gate, self.choice = whole.int8_gate, whole.choice
        # How it was chosen, shown beside the rest (``sharding``).
        self.decision: dict[str, Any] = {}
        # Every part but the first runs here; the first runs in the batch's own thread.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            shards - 1, thread_name_prefix="shard",
            initializer=torch.set_num_threads, initargs=(threads_each,),
        )  # fmt: skip

    @property
    def variant(self) -> str:
        return self.whole.variant

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Any:
        rows = batch.shape[0]
        if rows < self.shards:
            return self.whole.forward(batch, sizes)
        step = -(-rows // (PIECES_PER_THREAD * self.shards))
        pieces = torch.split(batch, step)
        answers: list[Any] = [None] * len(pieces)
        taken = itertools.count()  # next() is atomic: each piece is taken once
        failed = threading.Event()

        def work() -> None:
            while not failed.is_set() and (index := next(taken)) < len(pieces):
                mine = None if sizes is None else sizes[index * step : (index + 1) * step]
                try:
                    answers[index] = self.part.forward(pieces[index], mine)
                except BaseException:
                    failed.set()  # the batch has failed: the others take no more pieces
                    raise

        pending = [self._pool.submit(self._run, work) for _ in range(self.shards - 1)]
        try:
            threads = torch.get_num_threads()
            torch.set_num_threads(self.threads_each)
            try:
                work()
            finally:
                torch.set_num_threads(threads)
        finally:
            # Every piece ends before the batch's memory is handed on, even when one failed.
            concurrent.futures.wait(pending)
        for each in pending:
            each.result()
        return joined(answers)

    def _run(self, work: Callable[[], None]) -> None:
        with torch.inference_mode():
            work()

    def prepare(self, buckets: Sequence[int]) -> None:
        self.whole.prepare(buckets)

    def options(self) -> dict[str, Any]:
        return {**self.whole.options(), "shards": self.shards, "threads_each": self.threads_each}

    def describe(self) -> dict[str, Any]:
        shards = {"count": self.shards, "threads_each": self.threads_each, **self.decision}
        return {**self.whole.describe(), "shards": shards}


def joined(parts: Sequence[Any]) -> Any:
    """The outputs of consecutive parts of a batch as the output of the whole batch."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, Mapping):
        return {key: joined([each[key] for each in parts]) for key in first}
    if isinstance(first, tuple):  # a detector's padded (boxes, scores, labels, ...)
        joined_parts: list[Any] = [None if first[index] is None else
                        _padded_cat([each[index] for each in parts])
                        for index in range(len(first))]  # fmt: skip
        return type(first)(*joined_parts) if hasattr(first, "_fields") else tuple(joined_parts)
    if isinstance(first, list):  # one answer per image (torchvision's detectors)
        return [answer for each in parts for answer in each]
    raise TypeError(f"cannot join the parts of a batch's {type(first).__name__} output")


def _padded_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of parts whose second axis (a detector's K) may differ, padded with zeros."""
    if tensors[0].ndim < 2:
        return torch.cat(tensors)
    width = max(each.shape[1] for each in tensors)
    return torch.cat([
        pad(each, (0, 0) * (each.ndim - 2) + (0, width - each.shape[1])) for each in tensors
    ])  # fmt: skip

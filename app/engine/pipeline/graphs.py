"""Batch buckets and CUDA graphs: fixed shapes, captured once, replayed per batch."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``size`` rows (buckets sorted ascending)."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"a batch of {size} exceeds the largest bucket ({buckets[-1]})")
    return buckets[index]


class CudaGraphs:
    """One captured CUDA graph per bucket, with static input and output tensors.

    ``run(batch)`` copies a bucket-sized batch into the static input, replays, and returns the
    static output: read (or copy) it before the next ``run`` of the same bucket, which the
    engine guarantees by running forward passes one at a time on one stream.

    Captured while other threads may work on the same GPU (another model's batches, this
    model's previous version during a reload): the engine holds the device's lock meanwhile,
    so no other forward pass runs, and the capture is ``thread_local``, so that another
    thread's preprocessing (an allocation, a synchronisation) is not an error in the capture.
    cuDNN autotunes (``cudnn.benchmark``) only while capturing: a replay keeps the algorithms
    it captured, and the flag is process-wide, so it must not stay on for every other model.
    """

    def __init__(
        self,
        model: Callable[[torch.Tensor], torch.Tensor],
        buckets: Sequence[int],
        image_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._model = model
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            self._capture(model, buckets, image_shape, dtype, device)
        finally:
            torch.backends.cudnn.benchmark = benchmark

    def _capture(
        self,
        model: Callable[[torch.Tensor], torch.Tensor],
        buckets: Sequence[int],
        image_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Largest first: the shared memory pool is sized by the first capture.
        for size in sorted(buckets, reverse=True):
            static = torch.zeros((size, *image_shape), dtype=dtype, device=device)
            static = static.contiguous(memory_format=torch.channels_last)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):  # let cuDNN pick its algorithms before capture
                    model(static)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                output = model(static)
            self._inputs[size], self._outputs[size], self._graphs[size] = static, output, graph
        torch.cuda.synchronize(device)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, batch: torch.Tensor) -> torch.Tensor:
        size = batch.shape[0]
        self._inputs[size].copy_(batch)
        self._graphs[size].replay()
        return self._outputs[size]

"""A per-batch slot: the buffers one batch in flight uses, and every tensor it touches.

A slot is made once and reused; the engine owns ``max_inflight_batches`` of them. While a
batch runs, the slot also keeps a reference to each tensor the batch creates on the device
(decoded images, crops, staged copies, logits, top-k results) and drops them only after the
batch's done event has completed. Until then the caching allocator cannot hand their memory
to anyone else, whichever stream reads or writes it, so no ``record_stream`` bookkeeping is
needed and no tensor is freed under a kernel that still uses it.
"""

from __future__ import annotations

import math

import torch

from preprocessing.staging import host_buffer


class BatchSlot:
    """Buffers for one batch in flight, and the batch's tensors until it is done.

    - ``staged``: uint8 crops decoded on the CPU, pinned on CUDA, the source of the copy to the
      device (written by the host only while this slot's previous batch is over), for a model
      whose every image is fitted to one shape;
    - ``inputs(rows, canvas)``: the model's input batch on the device, in its dtype and memory
      format, for images of one canvas: a view of one buffer, made for the model's example
      canvas and grown when a batch needs more;
    - ``scores`` / ``indices``: flat pinned host buffers; ``readback`` views them as a
      *contiguous* ``[count, k]`` block, so the device-to-host copy is a real asynchronous DMA
      (a copy into a strided pinned view goes through a pageable temporary and blocks the
      thread until the forward pass has finished).
    """

    def __init__(
        self,
        *,
        rows: int,
        input_shape: tuple[int, int, int],
        input_dtype: torch.dtype,
        channels_last: bool,
        classes: int,
        device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> None:
        pinned = device.type == "cuda"
        self.rows = rows
        self.stream = stream
        self.staged = host_buffer((rows, *input_shape), torch.uint8, pinned=pinned)
        self.channels_last = channels_last
        self._buffer = torch.empty(rows * math.prod(input_shape), dtype=input_dtype,
                                   device=device)  # fmt: skip
        self.scores = host_buffer((rows * classes,), torch.float32, pinned=pinned)
        self.indices = host_buffer((rows * classes,), torch.int64, pinned=pinned)
        self._held: list[torch.Tensor] = []

    def reserve(self, rows: int, canvas: tuple[int, int]) -> None:
        """Make room for ``rows`` images of ``canvas`` (before any is written: a larger buffer
        is a new one). The slot's previous batch is over: nothing reads the old buffer."""
        size = rows * 3 * canvas[0] * canvas[1]
        if size > self._buffer.numel():
            self._buffer = torch.empty(size, dtype=self._buffer.dtype, device=self._buffer.device)

    def inputs(self, rows: int, canvas: tuple[int, int]) -> torch.Tensor:
        """``[rows, 3, height, width]`` of the input buffer, in the model's memory format: the
        same memory for the same canvas, whatever ``rows`` (within what was reserved)."""
        height, width = canvas
        size = rows * 3 * height * width
        if size > self._buffer.numel():
            raise ValueError(f"{rows} inputs of {width}x{height} were not reserved")
        flat = self._buffer[:size]
        if self.channels_last:
            return flat.view(rows, height, width, 3).permute(0, 3, 1, 2)
        return flat.view(rows, 3, height, width)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep these tensors alive until ``clear`` (called after the batch's done event)."""
        self._held.extend(tensors)

    @property
    def held(self) -> int:
        return len(self._held)

    def readback(self, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[count, k]`` views of the pinned result buffers."""
        size = count * k
        return self.scores[:size].view(count, k), self.indices[:size].view(count, k)

    def clear(self) -> None:
        self._held.clear()

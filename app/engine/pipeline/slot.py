"""A per-batch slot: the buffers one batch in flight uses, and every tensor it touches.

A slot is made once and reused; the engine owns ``max_inflight_batches`` of them. While a
batch runs, the slot also keeps a reference to each tensor the batch creates on the device
(decoded images, crops, staged copies, logits, top-k results) and drops them only after the
batch's done event has completed. Until then the caching allocator cannot hand their memory
to anyone else, whichever stream reads or writes it, so no ``record_stream`` bookkeeping is
needed and no tensor is freed under a kernel that still uses it.
"""

from __future__ import annotations

import torch

from preprocessing.staging import host_buffer


class BatchSlot:
    """Buffers for one batch in flight, and the batch's tensors until it is done.

    - ``staged``: uint8 crops decoded on the CPU, pinned on CUDA, the source of the copy to the
      device (written by the host only while this slot's previous batch is over);
    - ``inputs``: the model's input batch on the device, in its dtype and memory format;
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
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.inputs = torch.empty(
            (rows, *input_shape), dtype=input_dtype, device=device, memory_format=memory_format
        )
        self.scores = host_buffer((rows * classes,), torch.float32, pinned=pinned)
        self.indices = host_buffer((rows * classes,), torch.int64, pinned=pinned)
        self._held: list[torch.Tensor] = []

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

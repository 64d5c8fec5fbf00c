"""The interface between the engine and a runtime that executes the model.

The engine does everything around the forward pass (decoding, collating into a slot's input
batch, softmax and top-k, readback, one outcome per request, timings); a backend only turns a
ready input batch into logits. Adding a runtime is one new module here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ImageSizes = Sequence[tuple[int, int]]
# A detector's decoding: the graph's outputs, the batch's canvas, each image's size in it.
Decode = Callable[[Sequence[torch.Tensor], tuple[int, int], ImageSizes | None], Any]


class Backend(ABC):
    """Executes the model's forward pass on a ready input batch.

    Attributes a backend sets in its constructor:

    - ``device``: where its inputs must live and its logits come back;
    - ``input_dtype`` and ``channels_last``: the layout of the input batch the engine builds;
    - ``precision``: what is reported (``fp32``, ``bf16``, ``fp16``, ...);
    - ``fixed_shapes``: True when every batch must be padded to one of the warm-up buckets
      (captured CUDA graphs, kernels compiled per shape); False when any size runs as is;
    - ``serialized``: True when the engine must run one forward pass at a time (the device runs
      one batch at a time); False for a runtime that runs concurrent calls in streams of its
      own.
    """

    name: str = "backend"
    device: torch.device
    input_dtype: torch.dtype
    channels_last: bool = True
    precision: str
    fixed_shapes: bool = False
    serialized: bool = True
    # Images/s measured per candidate precision when PRECISION=auto had a choice to make.
    measured_rates: dict[str, float] | None = None
    # The precisions PRECISION=auto measured faster that failed their start-up check.
    rejected_precisions: dict[str, list[str]] | None = None
    # An INT8 model's accuracy gate, as judged when it was chosen to serve.
    int8_gate: dict[str, Any] | None = None
    choice: dict[str, Any] | None = None  # why BACKEND=auto chose this backend

    @property
    def variant(self) -> str:
        """Which flavour of the runtime serves (e.g. ``torchscript``)."""
        return "default"

    # A detector's decoding (anchors, boxes, suppression), which PyTorch runs on the outputs
    # of the graph a runtime serves, for the batch's canvas and each image's size in it
    # (``tasks.adapters.DetectorParts``).
    decode: Decode | None = None
    # A second graph of the model that the runtime runs for ``decode`` (a Faster R-CNN's box
    # head), where there is one.
    box_head: Path | None = None

    @abstractmethod
    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Any:
        """The model's output for ``batch``: logits ``[rows, classes]``, features, a mask's
        logits, or a detector's ``(boxes, scores, labels)`` (called under
        ``torch.inference_mode``, one call at a time, on the compute stream on CUDA).
        ``sizes``: each image's ``(height, width)`` in the batch's canvas, for a detector that
        keeps its boxes inside each image (None: each fills the canvas)."""

    def finished(
        self, outputs: Sequence[torch.Tensor], batch: torch.Tensor, sizes: ImageSizes | None
    ) -> Any:
        """A runtime's graph outputs as the model's output: decoded, or its one tensor."""
        if self.decode is not None:
            return self.decode(outputs, (int(batch.shape[-2]), int(batch.shape[-1])), sizes)
        (output,) = outputs
        return output

    def open_graph(self, path: Path) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        """Another graph of the model at ``path``, run as this runtime runs the model (its
        threads, its precision), taking its inputs in order and answering its outputs."""
        raise NotImplementedError(f"{self.name} runs one graph")

    def for_parts(self, parts: int, threads_each: int) -> Backend:
        """The same model opened again to run ``parts`` calls at once, each on
        ``threads_each`` threads (``backends.sharded``), its decoding left to the caller
        (``backends.sharded_backend``)."""
        raise NotImplementedError(f"{self.name} runs every batch whole")

    def prepare(self, buckets: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Get ready to serve these batch sizes (capture graphs, tune kernels): called once,
        before the warm-up batches."""

    def options(self) -> dict[str, Any]:
        """How the runtime is configured where that can change its answers or its speed
        (threads, hints, optimisation levels): what a kept verdict or gate report is bound
        to beside the artefact itself."""
        return {"name": self.name, "variant": self.variant, "precision": self.precision}

    def describe(self) -> dict[str, Any]:
        """What ``/v1/models`` shows about this backend."""
        described: dict[str, Any] = {"name": self.name, "variant": self.variant,
                                     "precision": self.precision,
                                     "fixed_shapes": self.fixed_shapes}  # fmt: skip
        if self.measured_rates:
            described["measured_images_per_second"] = self.measured_rates
        if self.rejected_precisions:
            described["rejected_precisions"] = self.rejected_precisions
        if self.int8_gate is not None:
            described["int8_gate"] = self.int8_gate
        if self.box_head is not None:
            described["box_head"] = str(self.box_head)
        if self.choice is not None:
            described["auto"] = self.choice
        return described

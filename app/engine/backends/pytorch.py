"""PyTorch itself: eager, TorchScript, inductor, and CUDA graphs on top of either."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.engine.backends.base import Backend, ImageSizes
from app.engine.device import NAMES
from app.engine.model.compile import optimize
from app.engine.pipeline.graphs import CudaGraphs


class TorchBackend(Backend):
    """The model as a ``torch.nn.Module`` on its device, in its dtype, channels_last.

    ``compile_mode`` is checked against eager at construction (see ``app.engine.model.compile``).
    With ``cuda_graphs`` on a CUDA device, ``prepare`` captures one graph per bucket, and from
    then on batches must be padded to those buckets. Inductor compiles one kernel set per
    shape, so it pads to buckets too; everything else runs the exact batch size, because
    padding a batch of 17 to 32 would compute 15 rows for nothing.
    """

    name = "torch"

    def __init__(
        self,
        module: nn.Module | None,
        device: torch.device,
        dtype: torch.dtype,
        input_shape: tuple[int, int, int],
        *,
        compile_mode: str = "none",
        cuda_graphs: bool = False,
        compiled_artifact: Path | None = None,
        compiled: nn.Module | None = None,
    ) -> None:
        """``compiled``: a model ``compile_mode`` made and checked before (the kept TorchScript
        artefact at ``compiled_artifact``), served as it is; otherwise ``module`` is compiled
        and checked here."""
        self.device = device
        self.input_dtype = dtype
        self.precision = NAMES[dtype]
        self.input_shape = input_shape
        if compiled is not None:
            self.model, self.compile_mode = compiled, compile_mode
        else:
            assert module is not None, "a module to compile, or a compiled one"
            model = module.to(device=device, dtype=dtype)
            model.to(memory_format=torch.channels_last)
            model.eval()
            # A random probe (not zeros, which only exercise the biases) checks what is made.
            probe = torch.randn((2, *input_shape), generator=torch.Generator().manual_seed(0))
            probe = probe.to(device=device, dtype=dtype)
            probe = probe.contiguous(memory_format=torch.channels_last)
            self.model, self.compile_mode = optimize(model, compile_mode, probe, compiled_artifact)
        # The TorchScript artefact that serves, if one does: a start-up check is kept beside it.
        self.path: Path | None = None
        if self.compile_mode == "torchscript" and compiled_artifact is not None:
            self.path = compiled_artifact if compiled_artifact.is_file() else None
        # A detector that keeps each image's boxes inside it is told their sizes.
        self._takes_sizes = bool(getattr(self.model, "takes_sizes", False))
        self._capture = cuda_graphs and device.type == "cuda"
        self._graphs: CudaGraphs | None = None
        self.fixed_shapes = self._capture or self.compile_mode == "inductor"

    @property
    def variant(self) -> str:
        if self._graphs is not None:
            return "cuda_graphs"
        return "eager" if self.compile_mode == "none" else self.compile_mode

    @property
    def graph_buckets(self) -> list[int]:
        return self._graphs.buckets if self._graphs is not None else []

    def prepare(self, buckets: Sequence[int]) -> None:
        if self._capture and self._graphs is None:
            with torch.inference_mode():
                self._graphs = CudaGraphs(
                    self.model, buckets, self.input_shape, self.input_dtype, self.device
                )

    def for_parts(self, parts: int, threads_each: int) -> Backend:
        # torch's threads are the calling thread's: each part's thread sets its own count.
        if self.device.type != "cpu" or self.fixed_shapes:
            raise NotImplementedError("on a GPU, or padded to buckets, a batch runs whole")
        return self

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Any:
        if self._graphs is not None:
            return self._graphs.run(batch)
        if self._takes_sizes:
            return self.model(batch, sizes)
        return self.model(batch)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "threads": torch.get_num_threads()}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "compile": self.compile_mode,
                "cuda_graphs": self.graph_buckets}  # fmt: skip

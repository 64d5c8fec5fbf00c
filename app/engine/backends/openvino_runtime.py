"""OpenVINO: an IR (fp32, or INT8 from a QDQ ONNX model) compiled once for the CPU.

The performance hint follows how batches run: ``LATENCY`` (one stream using every thread) when
forward passes run one at a time, as they do on a CPU whatever ``MAX_INFLIGHT_BATCHES`` says
(a second batch in flight only gets ready ahead); ``THROUGHPUT`` (several streams) only when
batches really overlap, and then each batch thread gets its own infer request and forward
passes are not serialised. With two streams and one batch computing, each stream has half of
the threads: resnet18 ran at 61 images/s that way against 113 with ``LATENCY`` on a 2-core AMD
EPYC. Requests run with the synchronous ``infer`` (which releases the GIL): asynchronous
requests were no faster over two runs, and on two cores the THROUGHPUT hint with two callers
was slower than LATENCY with one
(``benchmarks/studies/runtime_options/``). The inference precision is pinned:
OpenVINO would otherwise pick bf16 by itself on CPUs that have it.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.engine.backends.base import Backend
from app.engine.model.export import import_openvino

_PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}


class OpenVinoBackend(Backend):
    name = "openvino"
    channels_last = False

    def __init__(
        self, path: Path, *, precision: str, threads: int, concurrent_batches: int
    ) -> None:
        ov = import_openvino()
        self.device = torch.device("cpu")
        self.input_dtype = torch.float32
        self.precision = precision
        self.path = path
        self.hint = "THROUGHPUT" if concurrent_batches > 1 else "LATENCY"
        config = {
            "PERFORMANCE_HINT": self.hint,
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": _PRECISION_HINTS.get(precision, "f32"),
        }
        if self.hint == "THROUGHPUT":
            config["NUM_STREAMS"] = concurrent_batches
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
        self._outputs = len(self.compiled.outputs)
        self._config = {key: str(value) for key, value in config.items()}
        self.serialized = self.hint == "LATENCY"
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(max(1, concurrent_batches)):
            self._requests.put(self.compiled.create_infer_request())

    @property
    def variant(self) -> str:
        return self.hint.lower()

    def forward(self, batch: torch.Tensor) -> Any:
        request = self._requests.get()
        try:
            request.infer({0: batch.contiguous().numpy()}, share_inputs=True)
            # Copied: the request's buffers are reused.
            outputs: list[np.ndarray[Any, Any]] = [
                request.get_output_tensor(index).data.copy() for index in range(self._outputs)
            ]
        finally:
            self._requests.put(request)
        return self.finished([torch.from_numpy(each) for each in outputs])

    def options(self) -> dict[str, Any]:
        return {**super().options(), **self._config}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "artifact": str(self.path), "hint": self.hint}

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.engine.backends.base import Backend, ImageSizes
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
        self._core = core = ov.Core()
        self._compile_config = config
        self.compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
        self._outputs = len(self.compiled.outputs)
        self._config = {key: str(value) for key, value in config.items()}
        self.serialized = self.hint == "LATENCY"
        self._concurrent = max(1, concurrent_batches)
        self._requests = _requests(self.compiled, self._concurrent)

    @property
    def variant(self) -> str:
        return self.hint.lower()

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Any:
        return self.finished(_infer(self._requests, [batch], self._outputs), batch, sizes)

    def for_parts(self, parts: int, threads_each: int) -> Backend:
        # One stream per part: OpenVINO shares its threads out among the streams.
        return OpenVinoBackend(self.path, precision=self.precision,
                               threads=threads_each * parts, concurrent_batches=parts)  # fmt: skip

    def open_graph(self, path: Path) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        compiled = self._core.compile_model(self._core.read_model(str(path)), "CPU",
                                            self._compile_config)  # fmt: skip
        requests, outputs = _requests(compiled, self._concurrent), len(compiled.outputs)

        def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            return _infer(requests, inputs, outputs)

        return run

    def options(self) -> dict[str, Any]:
        return {**super().options(), **self._config}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "artifact": str(self.path), "hint": self.hint}


def _requests(compiled: Any, count: int) -> queue.SimpleQueue[Any]:
    """An infer request per batch that may run at once."""
    requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(count):
        requests.put(compiled.create_infer_request())
    return requests


def _infer(
    requests: queue.SimpleQueue[Any], inputs: Sequence[torch.Tensor], outputs: int
) -> list[torch.Tensor]:
    request = requests.get()
    try:
        request.infer({index: each.contiguous().numpy() for index, each in enumerate(inputs)},
                      share_inputs=True)  # fmt: skip
        # Copied: the request's buffers are reused.
        answered: list[np.ndarray[Any, Any]] = [
            request.get_output_tensor(index).data.copy() for index in range(outputs)
        ]
    finally:
        requests.put(request)
    return [torch.from_numpy(each) for each in answered]

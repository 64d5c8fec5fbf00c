"""ONNX Runtime: an exported ONNX model (fp32, or INT8 with QDQ nodes) in an InferenceSession.

Tuned rather than default: every graph optimisation (1.4-1.5x the basic level on resnet50
here, see ``benchmarks/studies/runtime_options/``), intra-op threads from the server's
thread budget (one inter-op thread: the engine runs one batch at a time), and no copies: on
a CPU the slot's input batch goes in as a NumPy view of its memory and the logits come back as
one (I/O binding measured no faster there), on CUDA I/O binding reads the slot's device batch
and writes the logits into a device tensor of ours. On CUDA the TensorRT and CUDA execution
providers come first, TensorRT with an engine cache beside the artefact, in the precision asked
for: fp32 TensorRT then the CUDA provider for ``fp32``; fp16 TensorRT alone for ``fp16``, which
is refused at start when TensorRT is not what runs (the CUDA provider would run the fp32 export
while the server said fp16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.engine.backends.base import Backend, ImageSizes
from app.engine.errors import MissingExtraError, StartupError
from app.engine.model.export import INPUT_NAME, OUTPUT_NAME


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingExtraError("BACKEND=onnxruntime", "onnx", exc) from None
    return onnxruntime


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    channels_last = False  # ONNX models take contiguous NCHW

    def __init__(
        self,
        path: Path,
        device: torch.device,
        *,
        precision: str,
        threads: int,
        classes: int,
    ) -> None:
        ort = import_onnxruntime()
        self.device = device
        self.input_dtype = torch.float32
        self.precision = precision
        self.path = path
        self.classes = classes
        self._session_options = options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only
        # Idle intra-op threads sleep instead of spinning: in a server the decode threads and
        # the event loop want those cores between batches (served resnet50 here: 34.0 images/s
        # without spinning, 33.4 with, two rounds each).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.providers = providers(device, path, precision)
        self.session = ort.InferenceSession(str(path), options, providers=self.providers)
        self._options = {"graph_optimization_level": str(options.graph_optimization_level),
                         "intra_op_threads": threads, "inter_op_threads": 1,
                         "execution_mode": str(options.execution_mode)}  # fmt: skip
        running = self.session.get_providers()
        if precision == "fp16" and running[:1] != ["TensorrtExecutionProvider"]:
            raise StartupError(
                "PRECISION=fp16 with BACKEND=onnxruntime runs on its TensorRT provider, which "
                f"is not available here (running: {', '.join(running)}): install "
                "onnxruntime-gpu with TensorRT, or serve PRECISION=fp32 (or BACKEND=torch for "
                "fp16)"
            )
        self._device_type = "cuda" if device.type == "cuda" else "cpu"
        self._device_id = device.index or 0
        self._outputs = [each.name for each in self.session.get_outputs()]
        whole = self._outputs == [OUTPUT_NAME]  # not a detector's graph
        if not whole and device.type == "cuda":
            raise StartupError(
                "a detector's graph runs on ONNX Runtime on the CPU; on a GPU serve it with "
                "BACKEND=torch"
            )
        self._row_shape = row_shape(self.session, classes) if whole else ()

    @property
    def variant(self) -> str:
        used = self.session.get_providers()
        return used[0].removesuffix("ExecutionProvider").lower() if used else "cpu"

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Any:
        batch = batch.contiguous()
        if self.device.type != "cuda":
            outputs = self.session.run(self._outputs, {INPUT_NAME: batch.numpy()})
            return self.finished([torch.from_numpy(each) for each in outputs], batch, sizes)
        # ONNX Runtime runs on a stream of its own: let the inputs' copies end first (its Run
        # returns once the logits are written).
        torch.cuda.current_stream(self.device).synchronize()
        logits = torch.empty((batch.shape[0], *self._row_shape), dtype=torch.float32,
                             device=self.device)  # fmt: skip
        binding = self.session.io_binding()
        binding.bind_input(INPUT_NAME, self._device_type, self._device_id, np.float32,
                           tuple(batch.shape), batch.data_ptr())  # fmt: skip
        binding.bind_output(OUTPUT_NAME, self._device_type, self._device_id, np.float32,
                            tuple(logits.shape), logits.data_ptr())  # fmt: skip
        self.session.run_with_iobinding(binding)
        return self.finished([logits], batch, sizes)

    def for_parts(self, parts: int, threads_each: int) -> Backend:
        # A session runs concurrent calls (each on the calling thread and its own pool).
        if self.device.type == "cuda":
            raise NotImplementedError("on a GPU a batch runs whole")
        return OnnxRuntimeBackend(self.path, self.device, precision=self.precision,
                                  threads=threads_each, classes=self.classes)  # fmt: skip

    def open_graph(self, path: Path) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        if self.device.type == "cuda":
            raise StartupError("a second graph runs on ONNX Runtime on the CPU")
        ort = import_onnxruntime()
        session = ort.InferenceSession(str(path), self._session_options,
                                       providers=["CPUExecutionProvider"])  # fmt: skip
        names = [each.name for each in session.get_inputs()]

        def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            feed = {
                name: each.contiguous().numpy() for name, each in zip(names, inputs, strict=True)
            }
            return [torch.from_numpy(each) for each in session.run(None, feed)]

        return run

    def options(self) -> dict[str, Any]:
        return {**super().options(), **self._options, "providers": self.session.get_providers()}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "artifact": str(self.path),
                "providers": self.session.get_providers()}  # fmt: skip


def row_shape(session: Any, classes: int) -> tuple[int, ...]:
    """One row of the output, as the model declares it after its batch axis: ``(classes,)``
    for a classifier, ``(dimensions,)`` for an encoder, ``(classes, height, width)`` for a
    segmenter. Bound on CUDA, where the output is written into a tensor of ours."""
    (output,) = [each for each in session.get_outputs() if each.name == OUTPUT_NAME]
    declared = list(output.shape)[1:]
    if declared and all(isinstance(size, int) for size in declared):
        return tuple(declared)
    return (classes,)


def providers(device: torch.device, path: Path, precision: str) -> list[Any]:
    """The execution providers, in order, that run ``precision`` and nothing else."""
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    shared = {"device_id": str(device.index or 0)}
    fp16 = precision == "fp16"
    # TensorRT builds fp16 engines only when told to; each precision has a cache of its own.
    cache = path.parent / f"tensorrt-cache-{precision}"
    tensorrt = {**shared, "trt_fp16_enable": str(fp16), "trt_engine_cache_enable": "True",
                "trt_engine_cache_path": str(cache)}  # fmt: skip
    if fp16:  # the CUDA provider has no fp16 here: it would run the fp32 export
        return [("TensorrtExecutionProvider", tensorrt), "CPUExecutionProvider"]
    return [
        ("TensorrtExecutionProvider", tensorrt),
        ("CUDAExecutionProvider", shared),
        "CPUExecutionProvider",
    ]

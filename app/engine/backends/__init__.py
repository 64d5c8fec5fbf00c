"""Runtimes for the forward pass, each behind the one small ``Backend`` interface."""

from __future__ import annotations

from pathlib import Path

import torch

from app.engine.backends.base import Backend, Decode
from app.engine.backends.pytorch import TorchBackend
from app.engine.backends.sharded import ShardedBackend

__all__ = [
    "RUNTIMES",
    "Backend",
    "ShardedBackend",
    "TorchBackend",
    "open_runtime",
    "sharded_backend",
]

RUNTIMES = ("onnxruntime", "openvino")


def open_runtime(
    name: str,
    path: Path,
    *,
    precision: str,
    threads: int,
    classes: int,
    device: torch.device | None = None,
    concurrent_batches: int = 1,
    decode: Decode | None = None,
    box_head: Path | None = None,
) -> Backend:
    """The runtime ``name`` serving the artefact at ``path``: the one way to open one, whether
    to serve, to choose, to quantise or to judge. ``concurrent_batches``: batches OpenVINO
    runs at once (one stream with every thread when 1). ``decode``: a detector's, on what its
    graph returns; ``box_head``: the graph of its box head, which the runtime then runs for
    it (``tasks.rcnn.RcnnDecode.with_box_head``)."""
    backend: Backend
    if name == "onnxruntime":
        from app.engine.backends.onnx_runtime import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(path, device or torch.device("cpu"), precision=precision,
                                     threads=threads, classes=classes)  # fmt: skip
    elif name == "openvino":
        from app.engine.backends.openvino_runtime import OpenVinoBackend

        backend = OpenVinoBackend(path, precision=precision, threads=threads,
                                  concurrent_batches=concurrent_batches)  # fmt: skip
    else:
        raise ValueError(f"no runtime {name!r}: {', '.join(RUNTIMES)}")
    return _decoding(backend, decode, box_head)


def sharded_backend(backend: Backend, shards: int, threads_each: int) -> ShardedBackend:
    """``backend``'s model run as ``shards`` parts of each batch side by side, ``threads_each``
    threads each (``NotImplementedError`` where it runs every batch whole): opened again for
    the parts, with its decoding, and a two-stage detector's box head on the parts' runtime."""
    part = backend.for_parts(shards, threads_each)
    if part is not backend:
        part = _decoding(part, backend.decode, backend.box_head)
    return ShardedBackend(backend, part, shards, threads_each)


def _decoding(backend: Backend, decode: Decode | None, box_head: Path | None) -> Backend:
    """``backend`` with a detector's ``decode``, its ``box_head`` graph run by ``backend``."""
    if box_head is not None:
        from app.engine.tasks.adapters import DetectorDecoding

        if not isinstance(decode, DetectorDecoding) or not decode.two_stage:
            raise ValueError("a box head is run for a two-stage detector's decoding")
        decode = decode.with_box_head(backend.open_graph(box_head))
        backend.box_head = box_head
    backend.decode = decode
    return backend

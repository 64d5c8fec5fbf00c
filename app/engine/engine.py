"""The inference engine: one batched forward pass per batch, one result or error per request."""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch.profiler import record_function

from app.engine.compile import optimize
from app.engine.device import NAMES
from app.engine.graphs import CudaGraphs, bucket_for
from app.engine.loading import LoadedModel
from app.engine.streams import Mark, streams_for
from app.metrics import Metrics
from preprocessing import (
    Buffer,
    ImageHeader,
    ImageLimits,
    PreparedImage,
    normalize_into,
    prepare,
    resize_crop,
)
from preprocessing.device import decode_jpegs
from preprocessing.staging import PinnedStaging, host_buffer

logger = logging.getLogger("batchserve")


@dataclass(slots=True)
class InferenceRequest:
    image: PreparedImage
    top_k: int


@dataclass(slots=True)
class Prediction:
    """Top-k classes of one image, and where its batch spent its time."""

    classes: list[dict[str, Any]]
    batch_size: int
    started: float  # time.perf_counter() when the batch started executing
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Slot:
    """The buffers one batch in flight owns: made once, reused, never allocated per request."""

    staged: torch.Tensor  # uint8 crops decoded on the CPU, pinned, for the copy to the device
    inputs: torch.Tensor  # the model's input batch on the device (dtype, channels_last)
    scores: torch.Tensor  # top-k results, pinned, for the copy back
    indices: torch.Tensor


class InferenceEngine:
    """Runs batches of prepared images through a model.

    ``run_batch`` is synchronous and thread-safe: the batcher calls it from up to
    ``max_inflight_batches`` worker threads, so that batch N+1 is decoded, copied and
    normalised while batch N runs. Forward passes are serialised: the device executes one
    batch at a time. On CUDA, batches are padded to fixed buckets (captured as CUDA graphs
    when asked), preprocessing and the forward pass run on separate streams, and host-device
    copies go through pinned buffers.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        *,
        limits: ImageLimits | None = None,
        metrics: Metrics | None = None,
        max_batch_size: int = 32,
        buckets: tuple[int, ...] | None = None,
        max_inflight_batches: int = 2,
        decode_on_device: bool = False,
        cuda_graphs: bool = False,
        compile_mode: str = "none",
    ) -> None:
        self.name = loaded.name
        self.weights = loaded.weights
        self.max_batch_size = max_batch_size
        self.labels = loaded.labels
        self.transform = loaded.transform
        self.device = device
        self.dtype = dtype
        self.limits = limits or ImageLimits(resize_size=loaded.transform.resize_size)
        self.decode_on_device = decode_on_device
        self.max_inflight_batches = max_inflight_batches
        self.buckets = tuple(sorted(set(buckets or (max_batch_size,)) | {max_batch_size}))
        # Fixed shapes on a GPU (cuDNN autotuning, CUDA graphs) and for compiled kernels; exact
        # sizes on a CPU otherwise, where padding would cost real compute.
        self.pads_to_buckets = device.type == "cuda" or compile_mode == "inductor"
        self._metrics = metrics
        model = loaded.module.to(device=device, dtype=dtype)
        model.to(memory_format=torch.channels_last)
        model.eval()
        # A random probe (not zeros, which only exercise the biases) checks a compiled model.
        probe = torch.randn((2, *self.input_shape), generator=torch.Generator().manual_seed(0))
        probe = probe.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        self._model, self.compile_mode = optimize(model, compile_mode, probe)
        self._streams = streams_for(device)
        self._slots = PinnedStaging(self._make_slot, size=max_inflight_batches)
        self._execute_lock = threading.Lock()
        self._use_graphs = cuda_graphs and device.type == "cuda"
        self._graphs: CudaGraphs | None = None
        self.warmup_timings: dict[int, float] = {}

    @property
    def precision(self) -> str:
        return NAMES[self.dtype]

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        size = self.transform.crop_size
        return (3, size, size)

    @property
    def model(self) -> torch.nn.Module:
        """The model as it runs: on the device, in its precision, channels_last."""
        return self._model

    @property
    def graph_buckets(self) -> list[int]:
        return self._graphs.buckets if self._graphs is not None else []

    def _make_slot(self, index: int) -> _Slot:
        pinned = self.device.type == "cuda"
        rows = self.max_batch_size
        inputs = torch.empty(
            (rows, *self.input_shape),
            dtype=self.dtype,
            device=self.device,
            memory_format=torch.channels_last,
        )
        classes = self.num_classes
        return _Slot(
            staged=host_buffer((rows, *self.input_shape), torch.uint8, pinned=pinned),
            inputs=inputs,
            scores=host_buffer((rows, classes), torch.float32, pinned=pinned),
            indices=host_buffer((rows, classes), torch.int64, pinned=pinned),
        )

    # -- per request (decode threads) ----------------------------------------------------

    def prepare(self, data: Buffer) -> PreparedImage:
        with record_function("batchserve.decode"):
            return prepare(
                data, self.transform, self.limits, device_decodes_jpeg=self.decode_on_device
            )

    # -- per batch (batcher threads) -----------------------------------------------------

    def run_batch(self, requests: list[InferenceRequest]) -> list[Prediction | BaseException]:
        """One result or exception per request. When the device runs out of memory, the batch
        is split in halves and each half retried, down to single requests."""
        try:
            return self._run(requests, record=True)
        except torch.OutOfMemoryError as exc:
            if len(requests) == 1:
                return [exc]
            logger.warning("out of memory with a batch of %d: retrying in halves", len(requests))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(requests) // 2
            return self.run_batch(requests[:half]) + self.run_batch(requests[half:])

    def _run(
        self, requests: list[InferenceRequest], *, record: bool
    ) -> list[Prediction | BaseException]:
        if len(requests) > self.max_batch_size:
            raise ValueError(f"{len(requests)} requests exceed the batch capacity")
        started = time.perf_counter()
        outcomes: list[Prediction | BaseException | None] = [None] * len(requests)
        slot = self._slots.acquire()
        try:
            with torch.inference_mode():
                self._execute(slot, requests, outcomes, started, record)
        finally:
            self._slots.release(slot)
        return [
            outcome if outcome is not None else RuntimeError("no result was produced")
            for outcome in outcomes
        ]

    def _execute(
        self,
        slot: _Slot,
        requests: list[InferenceRequest],
        outcomes: list[Prediction | BaseException | None],
        started: float,
        record: bool,
    ) -> None:
        streams = self._streams
        marks: dict[str, Mark] = {}
        with streams.preprocess():
            marks["start"] = streams.mark()
            batch, rows = self._collate(slot, requests, outcomes, marks)
            marks["collated"] = streams.mark()
        if not rows:
            return
        count = len(rows)
        kmax = max(requests[row].top_k for row in rows)
        with self._execute_lock, streams.compute(after=marks["collated"]):
            marks["forward_start"] = streams.mark()
            with record_function("batchserve.forward"):
                logits = self._forward(batch)[:count]
            marks["forward_end"] = streams.mark()
            with record_function("batchserve.postprocess"):
                scores, indices = torch.softmax(logits.float(), dim=1).topk(kmax, dim=1)
            marks["postprocessed"] = streams.mark()
            with record_function("batchserve.d2h"):
                slot.scores[:count, :kmax].copy_(scores, non_blocking=True)
                slot.indices[:count, :kmax].copy_(indices, non_blocking=True)
            marks["done"] = streams.mark()
        marks["done"].synchronize()  # this batch's event only: other batches keep running
        score_rows = slot.scores[:count, :kmax].tolist()
        index_rows = slot.indices[:count, :kmax].tolist()
        timings = self._timings(marks)
        labels = self.labels
        for position, row in enumerate(rows):
            k = requests[row].top_k
            classes = [
                {"index": index, "label": labels[index], "score": score}
                for index, score in zip(
                    index_rows[position][:k], score_rows[position][:k], strict=True
                )
            ]
            outcomes[row] = Prediction(classes, count, started, timings)
        if record and self._metrics is not None:
            for stage, seconds in timings.items():
                self._metrics.observe_stage(stage, seconds)
            self._metrics.device_busy.inc(marks["done"].seconds_since(marks["forward_start"]))

    def _timings(self, marks: dict[str, Mark]) -> dict[str, float]:
        timings: dict[str, float] = {}
        if "decoded" in marks:
            timings["decode"] = marks["decoded"].seconds_since(marks["start"])
        if self._streams.timed_on_device:
            timings["h2d"] = marks["staged"].seconds_since(marks["staging"])
        timings["collate"] = marks["collated"].seconds_since(marks["staged"])
        timings["forward"] = marks["forward_end"].seconds_since(marks["forward_start"])
        timings["postprocess"] = marks["postprocessed"].seconds_since(marks["forward_end"])
        if self._streams.timed_on_device:
            timings["d2h"] = marks["done"].seconds_since(marks["postprocessed"])
        return timings

    def _collate(
        self,
        slot: _Slot,
        requests: list[InferenceRequest],
        outcomes: list[Prediction | BaseException | None],
        marks: dict[str, Mark],
    ) -> tuple[torch.Tensor, list[int]]:
        """Decode (on the device) what is still encoded, bring every crop to the device, and
        normalise them into the slot's input batch. Returns the batch (padded to its bucket on
        CUDA) and, for each of its rows, the index of its request; a request that cannot join
        gets its own error in ``outcomes``."""
        on_device: dict[int, torch.Tensor] = {}
        on_host: dict[int, torch.Tensor] = {}
        encoded: list[tuple[int, Buffer, ImageHeader]] = []
        for index, request in enumerate(requests):
            image = request.image
            if image.pixels is not None and tuple(image.pixels.shape) == self.input_shape:
                on_host[index] = image.pixels
            elif image.pixels is None and image.data is not None:
                encoded.append((index, image.data, image.header))
            else:
                outcomes[index] = ValueError("the image was not prepared for this model")

        if encoded:
            with record_function("batchserve.decode"):
                decoded = decode_jpegs([(data, header) for _, data, header in encoded], self.device)
                for (index, _, _), result in zip(encoded, decoded, strict=True):
                    if isinstance(result, BaseException):
                        outcomes[index] = result
                        continue
                    crop = resize_crop(result, self.transform)
                    (on_host if crop.device.type == "cpu" else on_device)[index] = crop
            marks["decoded"] = self._streams.mark()

        marks["staging"] = self._streams.mark()
        if on_host and self.device.type != "cpu":
            with record_function("batchserve.h2d"):
                order = sorted(on_host)
                staged = slot.staged[: len(order)]
                torch.stack([on_host[index] for index in order], out=staged)
                arrived = staged.to(self.device, non_blocking=True)
                on_device.update(zip(order, arrived, strict=True))
        else:
            on_device.update(on_host)
        marks["staged"] = self._streams.mark()

        rows = sorted(on_device)
        if not rows:
            return slot.inputs[:0], rows
        size = bucket_for(len(rows), self.buckets) if self.pads_to_buckets else len(rows)
        with record_function("batchserve.collate"):
            # The slot's own buffer lives as long as the engine, so handing it from the copy
            # stream to the compute stream needs no record_stream: nothing is freed under it.
            normalize_into([on_device[index] for index in rows], slot.inputs, self.transform)
        return slot.inputs[:size], rows

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self._graphs is not None:
            return self._graphs.run(batch)
        logits: torch.Tensor = self._model(batch)
        return logits

    # -- start-up ------------------------------------------------------------------------

    def warmup(
        self, batch_sizes: tuple[int, ...] | None = None, rounds: int = 2
    ) -> dict[int, float]:
        """Run every batch size (default: every bucket); capture CUDA graphs if asked.

        Returns the last round's seconds per size, to seed the batcher's timing model.
        """
        sizes = tuple(sorted(set(batch_sizes or self.buckets)))
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # every shape is a bucket, seen here first
        timings: dict[int, float] = {}
        for batch_size in sizes:
            requests = self._synthetic(batch_size)
            for _ in range(rounds):
                started = time.perf_counter()
                for outcome in self._run(requests, record=False):
                    if isinstance(outcome, BaseException):
                        raise RuntimeError(
                            f"warm-up failed at batch size {batch_size}"
                        ) from outcome
                timings[batch_size] = time.perf_counter() - started
        if self._use_graphs:
            with torch.inference_mode():
                self._graphs = CudaGraphs(
                    self._model, self.buckets, self.input_shape, self.dtype, self.device
                )
            for batch_size in sizes:  # time the replayed graphs, which serve from now on
                started = time.perf_counter()
                self._run(self._synthetic(batch_size), record=False)
                timings[batch_size] = time.perf_counter() - started
        self.warmup_timings = timings
        logger.info(
            "warmed up %s on %s (%s%s): %s",
            self.name,
            self.device,
            self.precision,
            ", CUDA graphs" if self._graphs is not None else "",
            ", ".join(f"{n}: {t * 1000:.1f} ms" for n, t in timings.items()),
        )
        return timings

    def _synthetic(self, count: int) -> list[InferenceRequest]:
        """Requests as real ones arrive: encoded JPEGs when the device decodes them."""
        size = self.transform.crop_size + 16
        buffer = io.BytesIO()
        Image.new("RGB", (size + 8, size), (128, 100, 90)).save(buffer, "JPEG")
        data = buffer.getvalue()
        requests = []
        for _ in range(count):
            prepared = prepare(
                data, self.transform, self.limits, device_decodes_jpeg=self.decode_on_device
            )
            requests.append(InferenceRequest(prepared, top_k=1))
        return requests

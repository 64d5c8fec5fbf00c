"""The inference engine: one batched forward pass per batch, one result or error per request.

Longer than most modules on purpose: a batch's whole life (its slot, collation, the forward
pass and what each task reads from it, readback, the report) is one ordering of streams,
marks and held tensors, and reads best in one place; the parts with a life of their own
(slots, streams, collation, answers) are modules of their own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.profiler import record_function

from app.engine.backends import Backend
from app.engine.model.loading import LoadedModel
from app.engine.observer import BatchReport, EngineObserver
from app.engine.pipeline.collate import Collator
from app.engine.pipeline.graphs import bucket_for
from app.engine.pipeline.slot import BatchSlot
from app.engine.pipeline.streams import Mark, streams_for
from app.engine.tasks import answers, outputs
from app.engine.tasks.answers import Detected
from app.engine.warmup import WARMUP_IMAGES, warmup_images
from preprocessing import Buffer, ImageLimits, Placement, PreparedImage, prepare
from preprocessing.staging import PinnedStaging

logger = logging.getLogger("batchserve")

T = TypeVar("T")


@dataclass(slots=True)
class ImageRequest:
    image: PreparedImage
    top_k: int = 1
    dense: bool = False  # every class's probability too, as an array (not ``top_k`` dicts)
    min_score: float = 0.0  # a detector's boxes below it are not answered
    max_detections: int = 100
    masks: bool = True  # an instance segmenter's masks, with its boxes


@dataclass(slots=True)
class Prediction:
    """One image's answer, and where its batch spent its time: its top-k classes (and, asked
    ``dense``, every class's probability), its detections, its mask or its embedding, as its
    model's task gives."""

    classes: list[dict[str, Any]]
    batch_size: int
    started: float  # time.perf_counter() when the batch started executing
    timings: dict[str, float] = field(default_factory=dict)
    probabilities: np.ndarray[Any, Any] | None = None  # FP32 [classes], when asked ``dense``
    detected: Detected | None = None
    mask: np.ndarray[Any, Any] | None = None  # [H, W] class indices, in the image's pixels
    canvas: tuple[int, int] | None = None  # the input's (height, width) its batch ran at
    embedding: np.ndarray[Any, Any] | None = None  # FP32 [D]


class InferenceEngine:
    """Runs batches of prepared images through a backend.

    ``run_batch`` is synchronous and thread-safe: the batcher calls it from up to
    ``max_inflight_batches`` worker threads, so that batch N+1 is decoded, copied and
    normalised while batch N runs. Each batch takes a slot (see ``app.engine.pipeline.slot``)
    for its whole life. Forward passes are serialised: the device executes one batch at a time. On
    CUDA, preprocessing runs on the slot's stream and the forward pass on a compute stream,
    and host-device copies go through pinned buffers. Batches are padded to buckets only when
    the backend needs fixed shapes.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        backend: Backend,
        *,
        limits: ImageLimits | None = None,
        observer: EngineObserver | None = None,
        max_batch_size: int = 32,
        buckets: tuple[int, ...] | None = None,
        max_inflight_batches: int = 2,
        decode_on_device: bool = False,
        device_lock: threading.Lock | None = None,
        torch_threads: int | None = None,
        nms_iou: float | None = None,
        embed_normalize: bool = True,
    ) -> None:
        self.name = loaded.name
        self.task = loaded.task
        self.dimensions = loaded.dimensions
        # What a detector answers of each box beside it: ``masks``, ``keypoints``.
        self.instances = loaded.instances
        # The server's non-maximum suppression for a detector that runs none (None: none).
        self.nms_iou = nms_iou
        self.clips_boxes = loaded.clips_boxes
        self.resizes_logits = loaded.resizes_logits
        self.embed_normalize = embed_normalize
        self.weights = loaded.weights
        self.labels = loaded.labels
        self.transform = loaded.transform
        self.backend = backend
        self.device = backend.device
        self.max_batch_size = max_batch_size
        self.limits = limits or ImageLimits(resize_size=loaded.transform.resize_size)
        self.decode_on_device = decode_on_device
        self.max_inflight_batches = max_inflight_batches
        # torch's threads in each batch (collate, postprocess, a torch forward pass); None
        # leaves the calling thread's own.
        self.torch_threads = torch_threads
        self.buckets = tuple(sorted(set(buckets or (max_batch_size,)) | {max_batch_size}))
        self._observer = observer or EngineObserver()
        self._streams = streams_for(self.device)
        self._collator = Collator(self.transform, self.input_shape, self.device, self._streams,
                                  self._observer.on_decode_fallbacks)  # fmt: skip
        self._slots = PinnedStaging(self._make_slot, size=max_inflight_batches)
        # Forward passes are serialised on the device, across every engine that shares it.
        self._execute_lock = device_lock or threading.Lock()
        self.warmup_timings: dict[int, float] = {}
        # The start-up check against eager PyTorch, for backends that are checked that way.
        self.check: dict[str, Any] | None = None

    @property
    def precision(self) -> str:
        return self.backend.precision

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def canvas(self) -> tuple[int, int] | None:
        """The input tensor's ``(height, width)`` of every image; None where it follows each
        image's size."""
        return self.transform.example_canvas if self.transform.fit.fixed_canvas else None

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The input of one image of a 640 x 480 photo: what the model is probed and exported
        at (a model whose canvas follows each image's size takes others too)."""
        return (3, *self.transform.example_canvas)

    @property
    def pads_to_buckets(self) -> bool:
        return self.backend.fixed_shapes

    @property
    def slots(self) -> tuple[BatchSlot, ...]:
        return self._slots.slots

    def _make_slot(self, index: int) -> BatchSlot:
        return BatchSlot(
            rows=self.max_batch_size,
            input_shape=self.input_shape,
            input_dtype=self.backend.input_dtype,
            channels_last=self.backend.channels_last,
            classes=self.num_classes,
            device=self.device,
            stream=self._streams.new_copy_stream(),
        )

    # -- per request (decode threads) ----------------------------------------------------

    def prepare(self, data: Buffer) -> PreparedImage:
        with record_function("batchserve.decode"):
            return prepare(
                data, self.transform, self.limits, device_decodes_jpeg=self.decode_on_device
            )

    # -- per batch (batcher threads) -----------------------------------------------------

    def run_batch(self, requests: list[ImageRequest]) -> list[Prediction | BaseException]:
        """One result or exception per request. When the device runs out of memory, the batch
        is split in halves and each half retried, down to single requests."""
        return self._run_splitting(requests, report=True)

    def _run_splitting(
        self, requests: list[ImageRequest], *, report: bool
    ) -> list[Prediction | BaseException]:
        try:
            return self._run(requests, report=report)
        except torch.OutOfMemoryError as exc:
            if len(requests) == 1:
                return [exc]
            logger.warning("out of memory with a batch of %d: retrying in halves", len(requests))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(requests) // 2
            return self._run_splitting(requests[:half], report=report) + self._run_splitting(
                requests[half:], report=report
            )

    def _run(
        self, requests: list[ImageRequest], *, report: bool
    ) -> list[Prediction | BaseException]:
        if len(requests) > self.max_batch_size:
            raise ValueError(f"{len(requests)} requests exceed the batch capacity")
        if self.torch_threads is not None and torch.get_num_threads() != self.torch_threads:
            # Per thread, and the batcher's threads may have started with another count.
            torch.set_num_threads(self.torch_threads)
        started = time.perf_counter()
        slot = self._slots.acquire()
        finished = False
        try:
            with torch.inference_mode():
                outcomes = self._execute_by_canvas(slot, requests, started, report)
            finished = True
            return outcomes
        finally:
            if not finished:
                # Work of this batch may still be queued on the device: let it end before its
                # tensors are dropped and the slot's buffers are handed to another batch.
                self._streams.settle(slot.stream)
            slot.clear()
            self._slots.release(slot)

    def _execute_by_canvas(
        self, slot: BatchSlot, requests: list[ImageRequest], started: float, report: bool
    ) -> list[Prediction | BaseException]:
        """The requests' images, a forward pass per canvas: images share one only with images
        that get the same input tensor alone (the batcher forms batches of one canvas; a
        batch made elsewhere, such as the start-up check's, may mix them)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.image.canvas, []).append(index)
        if len(groups) == 1:
            ((canvas, _),) = groups.items()
            return self._execute(slot, requests, canvas, started, report)
        outcomes: list[Prediction | BaseException | None] = [None] * len(requests)
        for canvas, indices in groups.items():
            done = self._execute(slot, [requests[index] for index in indices], canvas, started,
                                 report)  # fmt: skip
            slot.clear()  # that forward pass is over: its tensors may go
            for index, outcome in zip(indices, done, strict=True):
                outcomes[index] = outcome
        return _completed(outcomes)

    def _execute(
        self,
        slot: BatchSlot,
        requests: list[ImageRequest],
        canvas: tuple[int, int],
        started: float,
        report: bool,
    ) -> list[Prediction | BaseException]:
        streams = self._streams
        marks: dict[str, Mark] = {}
        slot.reserve(self._padded(len(requests)), canvas)
        with streams.preprocess(slot.stream):
            marks["start"] = streams.mark()
            inputs, rows, errors = self._collator.collate(
                slot, [request.image for request in requests], marks, canvas
            )
            marks["collated"] = streams.mark()
        outcomes: list[Prediction | BaseException | None] = [None] * len(requests)
        for index, error in errors.items():
            outcomes[index] = error
        if not rows:
            return _completed(outcomes)

        count = len(rows)
        padded = self._padded(count)
        batch = slot.inputs(padded, canvas) if padded != count else inputs
        if self.task != "classify":
            return self._execute_task(slot, requests, rows, outcomes, batch, marks, started,
                                      report)  # fmt: skip
        kmax = max(requests[row].top_k for row in rows)
        scores_out, indices_out = slot.readback(count, kmax)

        def top_classes(output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits = output[:count]
            probabilities = torch.softmax(logits.float(), dim=1)
            scores, indices = probabilities.topk(kmax, dim=1)
            slot.hold(logits, scores, indices)
            return probabilities, scores, indices

        def read_back(top: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            # Contiguous pinned destinations: the copies are queued, the thread goes on.
            scores_out.copy_(top[1], non_blocking=True)
            indices_out.copy_(top[2], non_blocking=True)

        (probabilities, _, _), forward_queued_at, completed_at = self._forward(
            batch, None, marks, top_classes, read_back
        )
        # Dense answers as one array, not a dict per class and row (computed, so readable now).
        dense = (probabilities.cpu().numpy() if any(requests[row].dense for row in rows)
                 else None)  # fmt: skip

        score_rows = scores_out.tolist()
        index_rows = indices_out.tolist()
        stages = self._stages(marks)
        labels = self.labels
        for position, row in enumerate(rows):
            k = requests[row].top_k
            classes = [
                {"index": index, "label": labels[index], "score": score}
                for index, score in zip(
                    index_rows[position][:k], score_rows[position][:k], strict=True
                )
            ]
            wanted = dense[position] if dense is not None and requests[row].dense else None
            outcomes[row] = Prediction(classes, count, started, stages, wanted)
        if report:
            self._report(count, batch, marks, forward_queued_at, completed_at, stages)
        return _completed(outcomes)

    def _padded(self, count: int) -> int:
        """The rows a batch of ``count`` runs as: its bucket, where the backend needs one."""
        return bucket_for(count, self.buckets) if self.pads_to_buckets else count

    def _execute_task(
        self,
        slot: BatchSlot,
        requests: list[ImageRequest],
        rows: list[int],
        outcomes: list[Prediction | BaseException | None],
        batch: torch.Tensor,
        marks: dict[str, Mark],
        started: float,
        report: bool,
    ) -> list[Prediction | BaseException]:
        """A batch of a detector, a segmenter or an encoder: the forward pass (a detector told
        each image's size in the canvas), then its outputs read and turned into each image's
        answer on the batch (``tasks.answers``)."""
        count = len(rows)
        placements = [requests[row].image.placement for row in rows]
        sizes = [where.content for where in placements] if self.task == "detect" else None
        (kind, values), forward_queued_at, completed_at = self._forward(
            batch, sizes, marks,
            lambda output: self._answers(output, count, rows, requests, placements),
        )  # fmt: skip
        stages = self._stages(marks)
        canvas = (int(batch.shape[-2]), int(batch.shape[-1]))
        for position, row in enumerate(rows):
            prediction = Prediction([], count, started, stages, canvas=canvas)
            setattr(prediction, kind, values[position])
            outcomes[row] = prediction
        if report:
            self._report(count, batch, marks, forward_queued_at, completed_at, stages)
        return _completed(outcomes)

    def _forward(
        self,
        batch: torch.Tensor,
        sizes: list[tuple[int, int]] | None,
        marks: dict[str, Mark],
        postprocess: Callable[[Any], T],
        read_back: Callable[[T], None] | None = None,
    ) -> tuple[T, float, float]:
        """The batch's forward pass on the compute stream, once its preprocessing is done
        (its ``collated`` mark), under the device's lock when the backend is serialised; then
        ``postprocess`` of its output and ``read_back`` of the results, and a wait for this
        batch's own ``done`` event only, so that other batches keep running. Returns what
        ``postprocess`` made, when the forward pass was queued and when it all completed."""
        streams = self._streams
        lock = self._execute_lock if self.backend.serialized else contextlib.nullcontext()
        with lock, streams.compute(after=marks["collated"]):
            queued_at = time.perf_counter()
            marks["forward_start"] = streams.mark()
            with record_function("batchserve.forward"):
                output = self.backend.forward(batch, sizes)
            marks["forward_end"] = streams.mark()
            with record_function("batchserve.postprocess"):
                result = postprocess(output)
            marks["postprocessed"] = streams.mark()
            if read_back is not None:
                with record_function("batchserve.d2h"):
                    read_back(result)
            marks["done"] = streams.mark()
        marks["done"].synchronize()
        return result, queued_at, time.perf_counter()

    def _answers(
        self,
        output: Any,
        count: int,
        rows: list[int],
        requests: list[ImageRequest],
        placements: list[Placement],
    ) -> tuple[str, Sequence[Any]]:
        """Which field of each row's prediction the task fills, and each row's value."""
        if self.task == "detect":
            wanted = [requests[row] for row in rows]
            return "detected", answers.detections(
                outputs.detections(output), placements,
                [each.min_score for each in wanted], [each.max_detections for each in wanted],
                self.nms_iou, [each.masks for each in wanted], clip=self.clips_boxes,
            )  # fmt: skip
        if self.task == "segment":
            return "mask", answers.masks(outputs.segmentation(output)[:count], placements,
                                         resize_logits=self.resizes_logits)  # fmt: skip
        features = outputs.vectors(output)[:count]
        return "embedding", list(answers.embeddings(features, self.embed_normalize))

    def _report(
        self,
        count: int,
        batch: torch.Tensor,
        marks: dict[str, Mark],
        forward_queued_at: float,
        completed_at: float,
        stages: dict[str, float],
    ) -> None:
        self._observer.on_batch(
            BatchReport(
                rows=count,
                padded_rows=int(batch.shape[0]),
                canvas=(int(batch.shape[-2]), int(batch.shape[-1])),
                preprocess_s=marks["collated"].seconds_since(marks["start"]),
                busy_s=marks["done"].seconds_since(marks["forward_start"]),
                forward_queued_at=forward_queued_at,
                completed_at=completed_at,
                stages=stages,
            )
        )

    def _stages(self, marks: dict[str, Mark]) -> dict[str, float]:
        stages: dict[str, float] = {}
        if "decoded" in marks:
            stages["device_decode"] = marks["decoded"].seconds_since(marks["start"])
        if self._streams.timed_on_device:
            stages["h2d"] = marks["staged"].seconds_since(marks["staging"])
        stages["collate"] = marks["collated"].seconds_since(marks["staged"])
        stages["forward"] = marks["forward_end"].seconds_since(marks["forward_start"])
        stages["postprocess"] = marks["postprocessed"].seconds_since(marks["forward_end"])
        if self._streams.timed_on_device:
            stages["d2h"] = marks["done"].seconds_since(marks["postprocessed"])
        return stages

    # -- start-up ------------------------------------------------------------------------

    def warmup(
        self, batch_sizes: tuple[int, ...] | None = None, rounds: int = 2
    ) -> dict[int, float]:
        """Let the backend prepare every bucket, then run every batch size (default: every
        bucket) through the whole pipeline.

        Returns the last round's seconds per size, to seed the batcher's timing model.
        """
        sizes = tuple(sorted(set(batch_sizes or self.buckets)))
        # No other forward pass on this device while the backend prepares: a CUDA graph's
        # capture must not overlap another model's (or version's) batch.
        with self._execute_lock if self._streams.timed_on_device else contextlib.nullcontext():
            self.backend.prepare(self.buckets)
        # A few images of different sizes run decoding and resizing; batches repeat them.
        prepared = [self.prepare(data) for data in warmup_images(WARMUP_IMAGES)]
        timings: dict[int, float] = {}
        for batch_size in sizes:
            requests = [
                ImageRequest(prepared[index % len(prepared)], top_k=1)
                for index in range(batch_size)
            ]
            for _ in range(rounds):
                started = time.perf_counter()
                for outcome in self._run(requests, report=False):
                    if isinstance(outcome, BaseException):
                        raise RuntimeError(
                            f"warm-up failed at batch size {batch_size}"
                        ) from outcome
                timings[batch_size] = time.perf_counter() - started
        self.warmup_timings = dict(sorted({**self.warmup_timings, **timings}.items()))
        logger.info(
            "warmed up %s on %s (%s, %s %s): %s",
            self.name,
            self.device,
            self.precision,
            self.backend.name,
            self.backend.variant,
            ", ".join(f"{n}: {t * 1000:.1f} ms" for n, t in timings.items()),
        )
        return timings


def _completed(
    outcomes: list[Prediction | BaseException | None],
) -> list[Prediction | BaseException]:
    return [
        outcome if outcome is not None else RuntimeError("no result was produced")
        for outcome in outcomes
    ]

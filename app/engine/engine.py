"""The inference engine: one batched forward pass per batch, one result or error per request."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from app.engine.device import NAMES
from app.engine.loading import LoadedModel
from app.metrics import Metrics
from preprocessing import (
    Buffer,
    ImageFormat,
    ImageHeader,
    ImageLimits,
    PreparedImage,
    normalize_into,
    prepare,
)

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


class InferenceEngine:
    """Runs batches of prepared images through a model.

    ``run_batch`` is synchronous and thread-safe: the batcher calls it from up to
    ``max_inflight_batches`` worker threads, so that batch N+1 is collated while batch N runs.
    The forward pass itself is serialised: the device executes one batch at a time.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        *,
        limits: ImageLimits | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.name = loaded.name
        self.weights = loaded.weights
        self.labels = loaded.labels
        self.transform = loaded.transform
        self.device = device
        self.dtype = dtype
        self.limits = limits or ImageLimits(resize_size=loaded.transform.resize_size)
        self._metrics = metrics
        self._model = loaded.module.to(device=device, dtype=dtype)
        self._model.to(memory_format=torch.channels_last)
        self._model.eval()
        self._execute_lock = threading.Lock()
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

    # -- per request (decode threads) ----------------------------------------------------

    def prepare(self, data: Buffer) -> PreparedImage:
        with record_function("batchserve.decode"):
            return prepare(data, self.transform, self.limits)

    # -- per batch (batcher threads) -----------------------------------------------------

    def run_batch(self, requests: list[InferenceRequest]) -> list[Prediction | BaseException]:
        return self._run(requests, record=True)

    def _run(
        self, requests: list[InferenceRequest], *, record: bool
    ) -> list[Prediction | BaseException]:
        started = time.perf_counter()
        outcomes: list[Prediction | BaseException | None] = [None] * len(requests)
        with torch.inference_mode():
            with record_function("batchserve.collate"):
                batch, rows = self._collate(requests, outcomes)
            collated = time.perf_counter()
            if rows:
                with self._execute_lock:
                    executing = time.perf_counter()
                    with record_function("batchserve.forward"):
                        logits = self._model(batch)
                    forwarded = time.perf_counter()
                    with record_function("batchserve.postprocess"):
                        kmax = max(requests[row].top_k for row in rows)
                        scores, indices = torch.softmax(logits.float(), dim=1).topk(kmax, dim=1)
                        score_rows, index_rows = scores.tolist(), indices.tolist()
                    finished = time.perf_counter()
                timings = {
                    "collate": collated - started,
                    "forward": forwarded - executing,
                    "postprocess": finished - forwarded,
                }
                labels = self.labels
                for position, row in enumerate(rows):
                    k = requests[row].top_k
                    classes = [
                        {"index": index, "label": labels[index], "score": score}
                        for index, score in zip(
                            index_rows[position][:k], score_rows[position][:k], strict=True
                        )
                    ]
                    outcomes[row] = Prediction(classes, len(rows), started, timings)
                if record and self._metrics is not None:
                    for stage, seconds in timings.items():
                        self._metrics.observe_stage(stage, seconds)
                    self._metrics.device_busy.inc(finished - executing)
        return [
            outcome if outcome is not None else RuntimeError("no result was produced")
            for outcome in outcomes
        ]

    def _collate(
        self,
        requests: list[InferenceRequest],
        outcomes: list[Prediction | BaseException | None],
    ) -> tuple[torch.Tensor, list[int]]:
        """Stack the requests' crops into one normalized input batch.

        Returns the batch and, for each of its rows, the index of its request; requests that
        cannot join (no decoded pixels) get their error in ``outcomes`` instead.
        """
        rows: list[int] = []
        crops: list[torch.Tensor] = []
        for index, request in enumerate(requests):
            pixels = request.image.pixels
            if pixels is None or tuple(pixels.shape) != self.input_shape:
                outcomes[index] = ValueError("the image was not decoded to the model's input size")
                continue
            rows.append(index)
            crops.append(pixels)
        batch = torch.empty(
            (len(rows), *self.input_shape),
            dtype=self.dtype,
            device=self.device,
            memory_format=torch.channels_last,
        )
        if rows:
            normalize_into(crops, batch, self.transform)
        return batch, rows

    # -- start-up ------------------------------------------------------------------------

    def warmup(self, batch_sizes: tuple[int, ...], rounds: int = 2) -> dict[int, float]:
        """Run every batch size once or more; return the last round's seconds per size."""
        size = self.transform.crop_size
        header = ImageHeader(ImageFormat.JPEG, size, size)
        timings: dict[int, float] = {}
        for batch_size in batch_sizes:
            requests = [
                InferenceRequest(
                    PreparedImage(
                        header, pixels=torch.full((3, size, size), 128, dtype=torch.uint8)
                    ),
                    top_k=1,
                )
                for _ in range(batch_size)
            ]
            for _ in range(rounds):
                started = time.perf_counter()
                for outcome in self._run(requests, record=False):
                    if isinstance(outcome, BaseException):
                        raise RuntimeError(
                            f"warm-up failed at batch size {batch_size}"
                        ) from outcome
                timings[batch_size] = time.perf_counter() - started
        self.warmup_timings = timings
        logger.info(
            "warmed up %s on %s (%s): %s",
            self.name,
            self.device,
            self.precision,
            ", ".join(f"{n}: {t * 1000:.1f} ms" for n, t in timings.items()),
        )
        return timings

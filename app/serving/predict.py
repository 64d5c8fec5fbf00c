"""The prediction path, one call per request: ``Predictor.infer``. It knows nothing of HTTP or
gRPC (``app.serving.inference`` says what a front end hands over and gets back).

In order: find the version and admit the request (before its body is read, so that an
overloaded server refuses at once), read the body counting its bytes against the ticket,
parse it (in the parse threads when it is large), work out its deadline and priority, decode
(on the CPU: decode, resize, crop) in the decode threads, the most urgent first, and enqueue
each image as its own batcher item, so that images of different clients share batches; the
items are withdrawn when the caller goes away or one of them fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from app.engine import ImageRequest, InferenceEngine, Prediction
from app.errors import (
    InvalidInputError,
    InvalidParameterError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
)
from app.metrics import Metrics
from app.model_config import ModelConfig
from app.serving.admission import Admission, Ticket
from app.serving.decoding import PriorityPool
from app.serving.inference import (
    Cancelled,
    InferenceRequest,
    InferenceResponse,
    Inputs,
    ModelDescription,
    ModelFacts,
    Parsed,
)
from app.serving.registry import Registry
from app.serving.version import ModelVersion
from app.settings import Settings
from batching import DynamicBatcher
from batching.threads import LoopThreads
from preprocessing import (
    InvalidImageError,
    PreparedImage,
    TransformConfig,
    prepare_normalized,
    prepare_pixels,
)

Outcome = TypeVar("Outcome")


class Admitted:
    """An admitted request: the version that will answer it and its admission ticket. Closed
    when the request is answered (or fails), in every case."""

    def __init__(self, version: ModelVersion, ticket: Ticket) -> None:
        self.version = version
        self.ticket = ticket
        self._open = True
        version.enter()

    @property
    def engine(self) -> InferenceEngine:
        engine = self.version.engine
        if engine is None:
            raise self._gone()
        return engine

    @property
    def batcher(self) -> DynamicBatcher[ImageRequest, Prediction]:
        """The version's batcher; ``NotReadyError`` once it is closed (a version admits only
        while it serves, but its drain may end while a request it admitted still decodes)."""
        batcher = self.version.batcher
        if batcher is None:
            raise self._gone()
        return batcher

    def _gone(self) -> NotReadyError:
        version = self.version
        return NotReadyError(f"{version.name} is {version.reason}", headers={"Retry-After": "1"})

    def close(self) -> None:
        if self._open:
            self._open = False
            self.ticket.close()
            self.version.leave()


# Threads that parse request bodies: Python-bound work (the GIL), so more would not go faster.
PARSE_THREADS = 2


class Predictor:
    """The serving core: every front end's way to a prediction."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        admission: Admission,
        metrics: Metrics,
        decode_threads: LoopThreads,
        parse_threads: LoopThreads | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.admission = admission
        self.metrics = metrics
        self.decoding = PriorityPool(decode_threads)
        # Request bodies (JSON, base64, flattening) are parsed in threads of their own, so that
        # a burst of large ones does not hold the decode threads that every image needs.
        self.parsing = (PriorityPool(parse_threads) if parse_threads is not None
                        else self.decoding)  # fmt: skip

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Answer one request, or raise its typed error (``Cancelled`` when the caller went
        away first)."""
        started = time.perf_counter()
        admitted = self._admit(request.model, request.version, request.declared_bytes,
                               request.priority)  # fmt: skip
        try:
            version = admitted.version
            if request.named is not None:
                request.named(version.model)
            engine = admitted.engine
            settings = self.settings
            facts = ModelFacts(engine.num_classes, engine.canvas,
                               settings.images_per_request, settings.max_image_bytes,
                               engine.task, engine.instances)  # fmt: skip
            # What the transport says is checked before a byte of the body is read.
            level = self._priority_level(admitted, request.priority)
            if request.top_k is not None:
                self._top_k(admitted, request.top_k)
            _detection_limits(request.min_score, request.max_detections)
            body = await request.body.read(lambda total: self._reserve(admitted, total),
                                           settings.max_image_bytes)  # fmt: skip
            parsed: Parsed
            if request.parse_off_loop:
                parsed = await self.parsing.run(level, request.parse, body, facts)
            else:
                parsed = request.parse(body, facts)
            del body
            parse_s = time.perf_counter() - started
            version.metrics.observe_stage("parse", parse_s)
            if parsed.priority is not None:
                level = self._priority_level(admitted, parsed.priority)
            timeout = _earlier(request.timeout_s, parsed.timeout_s)
            deadline = self._deadline(admitted, timeout, request.arrived)
            top_k = self._top_k(admitted, parsed.top_k if parsed.top_k is not None
                                else request.top_k)  # fmt: skip
            config = version.config
            ask = _Ask(
                top_k, parsed.dense,
                _first(parsed.min_score, request.min_score, config.min_score),
                _first(parsed.max_detections, request.max_detections, config.max_detections),
                _first(parsed.masks, request.masks),
            )  # fmt: skip
            _detection_limits(ask.min_score, ask.max_detections)
            images = await self._prepare(admitted, parsed.inputs, level)
            detail = parsed.detail
            # From here on only the decoded images wait (the batcher counts them): the body's
            # parsed form (a JSON tensor is millions of Python numbers) goes now.
            del parsed
            submitted = time.perf_counter()
            predictions = await self._predict(admitted, images, ask, deadline, level,
                                              request.cancelled)  # fmt: skip
        finally:
            admitted.close()
        first = predictions[0]
        timings = {"parse": parse_s, "decode": images[0].decode_s,
                   "queue": max(0.0, first.started - submitted), **first.timings}  # fmt: skip
        return InferenceResponse(version.model, str(version.version), predictions,
                                 facts.classes, detail, timings,
                                 version.metrics.observe_stage, engine.task,
                                 engine.labels, engine.embed_normalize,
                                 engine.instances)  # fmt: skip

    def describe(self, model: str, version: str | int | None = None) -> ModelDescription:
        """What a serving version of ``model`` takes and gives (``NotReadyError`` while it
        has no engine, ``NotFoundError`` when there is no such version)."""
        serving = self.registry.resolve(model, version)
        engine = serving.engine
        if engine is None:
            raise NotReadyError(f"{serving.name} is {serving.reason}",
                                headers={"Retry-After": "1"})  # fmt: skip
        versions = [str(number) for number in sorted(self.registry.models.get(model, {}))]
        return ModelDescription(model, versions, engine.backend.name, engine.num_classes,
                                engine.canvas, engine.task, engine.dimensions,
                                engine.instances)  # fmt: skip

    def _admit(
        self,
        model: str | None,
        version: str | int | None,
        declared_bytes: int = 0,
        priority: int | None = None,
    ) -> Admitted:
        """Find the version and admit one request of ``declared_bytes`` for it (at most
        ``MAX_IMAGE_BYTES``: a larger body is refused once read), or raise a typed error
        (not found, not ready, overloaded) before anything is read. When admission is full, a
        request whose ``priority`` is known displaces the newest waiting request of a lower
        priority of the same model, which is answered ``overloaded`` in its place."""
        serving = self.registry.resolve(model, version)
        if not serving.ready:
            raise NotReadyError(f"{serving.name} is {serving.reason}",
                                headers={"Retry-After": "1"})  # fmt: skip
        declared = min(declared_bytes, self.settings.max_image_bytes)
        try:
            try:
                ticket = self.admission.admit(serving.model, declared)
            except OverloadedError:
                if not self._displace(serving, priority):
                    raise
                ticket = self.admission.admit(serving.model, declared)
        except OverloadedError:
            self.metrics.on_reject("overloaded", serving.model)
            raise
        return Admitted(serving, ticket)

    def _displace(self, serving: ModelVersion, priority: int | None) -> bool:
        """Make room for a request of ``priority`` in ``serving``'s model (any version)."""
        if priority is None:
            return False
        try:
            level = _level(serving.config, priority)
        except InvalidParameterError:
            return False  # refused as invalid later, where the request's errors are answered
        versions = self.registry.models.get(serving.model, {}).values()
        return any(
            version.batcher is not None and version.batcher.displace_below(level)
            for version in versions
        )

    def _reserve(self, admitted: Admitted, total_bytes: int) -> None:
        """Count ``total_bytes`` of the body read so far against the ticket."""
        try:
            admitted.ticket.reserve(total_bytes)
        except OverloadedError:  # the body outgrew what is left of MAX_QUEUE_BYTES
            self.metrics.on_reject("overloaded", admitted.version.model)
            raise

    def _deadline(self, admitted: Admitted, timeout_s: float | None, arrived: float) -> float:
        """The batcher deadline of a request that arrived at ``arrived`` (perf_counter) with
        ``timeout_s`` (None: ``REQUEST_TIMEOUT_MS`` of its model; at most
        ``MAX_REQUEST_TIMEOUT_MS``)."""
        if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s <= 0):
            raise InvalidParameterError("the timeout must be a positive number")
        batcher = admitted.batcher
        waited = time.perf_counter() - arrived
        settings = admitted.version.config
        # A client may shorten its deadline at will, but lengthen it only up to the cap.
        allowed = min(timeout_s or settings.request_timeout_s, settings.max_request_timeout_s)
        return batcher.now() + allowed - waited

    def _top_k(self, admitted: Admitted, requested: int | None) -> int:
        """How many classes to return: ``requested`` (None: the model's ``TOP_K``), at most
        the model's classes."""
        if admitted.engine.task != "classify":
            return 1  # a detector's, segmenter's or encoder's answer has no top classes
        k = admitted.version.config.top_k if requested is None else requested
        classes = admitted.engine.num_classes
        if not 1 <= k <= classes:
            raise InvalidParameterError(f"top_k must be at most {classes}")
        return k

    def _priority_level(self, admitted: Admitted, priority: int | None) -> int:
        """The batcher level of a priority on the protocol's scale: 1 first, up to
        ``PRIORITY_LEVELS``; 0 or None is ``DEFAULT_PRIORITY``."""
        return _level(admitted.version.config, priority)

    async def _prepare(
        self, admitted: Admitted, inputs: Inputs, level: int | None = None
    ) -> list[PreparedImage]:
        """Check the inputs against the model and decode (on the CPU: decode, resize, crop)
        in the decode threads, the most urgent ``level`` first (None: the default)."""
        engine = admitted.engine
        limit = self.settings.images_per_request
        if not 1 <= len(inputs) <= limit:
            raise InvalidInputError(
                f"a request carries 1 to {limit} images (MAX_IMAGES_PER_REQUEST), not {len(inputs)}"
            )
        try:
            admitted.ticket.count_images(len(inputs))
        except OverloadedError:
            self.metrics.on_reject("overloaded", admitted.version.model)
            raise
        if level is None:
            level = admitted.version.config.default_priority - 1
        stage = admitted.version.metrics.observe_stage
        if inputs.kind == "encoded":
            largest = self.settings.max_image_bytes
            if any(len(item) > largest for item in inputs.items):
                raise PayloadTooLargeError(f"an image is larger than {largest} bytes")
            if len(inputs) == 1:  # most requests: no task and no gathering future for one job
                images = [await self.decoding.run(level, engine.prepare, inputs.items[0])]
            else:
                images = await asyncio.gather(*(
                    self.decoding.run(level, engine.prepare, data) for data in inputs.items
                ))  # fmt: skip
            for image in images:
                if image.pixels is not None:  # decoded here; a device decode is timed per batch
                    stage("decode", image.decode_s)
            return list(images)
        array = np.asarray(inputs.items)
        if inputs.kind == "pixels":
            if array.ndim != 4 or array.shape[3] != 3 or array.dtype != np.uint8:
                raise InvalidInputError("pixels must be UINT8 of shape [N, H, W, 3]")

            pixels = torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2)

            def resize() -> list[PreparedImage]:
                return [prepare_pixels(image, engine.transform, engine.limits) for image in pixels]

            return await self.decoding.run(level, resize)
        if array.ndim != 4 or array.shape[1] != 3:
            raise InvalidInputError("a tensor must have shape [N, 3, height, width]")
        # Copying and checking megabytes of floats: in a thread, not on the event loop.
        return await self.decoding.run(level, _normalized_images, array, engine.transform)

    async def _predict(
        self,
        admitted: Admitted,
        images: Sequence[PreparedImage],
        ask: _Ask,
        deadline: float,
        level: int,
        cancelled: Callable[[], Awaitable[Any]] | None = None,
    ) -> list[Prediction]:
        """Each image as its own batcher item (they may share batches with other clients'
        items); the results in order, or the first error, or ``Cancelled`` when what
        ``cancelled()`` returns completes first (the caller went away). The other items are
        withdrawn as soon as one fails or the caller goes away. Each is asked what ``ask``
        asks (its classes, its detections' bounds)."""
        batcher = admitted.batcher
        # The ticket hands its bytes to the batcher in one step (nothing is awaited in
        # between), so that admission never sees them counted twice or not at all.
        admitted.ticket.close()
        futures: list[asyncio.Future[Prediction]] = []
        try:
            for image in images:
                cost = held_bytes(image)
                item = ImageRequest(image, ask.top_k, ask.dense, ask.min_score,
                                    ask.max_detections, ask.masks)  # fmt: skip
                # Images share a batch only with images of the same input shape.
                futures.append(batcher.enqueue(item, deadline, cost=cost, priority=level,
                                               key=image.canvas))  # fmt: skip
            return await _gather_or_cancel(futures, cancelled)
        finally:
            for future in futures:
                future.cancel()  # no-op for the finished ones; withdraws the rest


async def _gather_or_cancel(
    futures: list[asyncio.Future[Prediction]], cancelled: Callable[[], Awaitable[Any]] | None
) -> list[Prediction]:
    if len(futures) == 1:  # most requests: the one future, without a gathering one around it
        return [await _or_cancel(futures[0], cancelled)]
    return await _or_cancel(asyncio.gather(*futures), cancelled)


async def _or_cancel(
    future: asyncio.Future[Outcome], cancelled: Callable[[], Awaitable[Any]] | None
) -> Outcome:
    """``future``'s result, or ``Cancelled`` (and ``future`` cancelled) when what
    ``cancelled()`` returns completes first."""
    if cancelled is None:
        return await future
    watcher = asyncio.ensure_future(cancelled())
    try:
        await asyncio.wait((future, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if future.done():
        return future.result()
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await future
    raise Cancelled


@dataclass(frozen=True, slots=True)
class _Ask:
    """What every image of a request asks of the model."""

    top_k: int
    dense: bool
    min_score: float
    max_detections: int
    masks: bool


def _first(*values: Any) -> Any:
    """The first of ``values`` that is given."""
    return next(value for value in values if value is not None)


def _detection_limits(min_score: float | None, max_detections: int | None) -> None:
    """A detector's bounds asked for, checked (None: not asked)."""
    if min_score is not None and not 0 <= min_score <= 1:
        raise InvalidParameterError("min_score must be between 0 and 1")
    if max_detections is not None and max_detections < 1:
        raise InvalidParameterError("max_detections must be at least 1")


def _earlier(first: float | None, second: float | None) -> float | None:
    """The shorter of two timeouts, either of which may be missing."""
    if first is None:
        return second
    return first if second is None else min(first, second)


def _normalized_images(
    array: np.ndarray[Any, Any], transform: TransformConfig
) -> list[PreparedImage]:
    """A client's normalised tensor ``[N, 3, H, W]`` (the model's canvas): its own copy,
    finite throughout."""
    values = torch.from_numpy(np.array(array, dtype=np.float32))
    if not torch.isfinite(values).all():
        raise InvalidInputError("the tensor holds NaN or infinite values")
    try:
        return [prepare_normalized(image, transform) for image in values]
    except InvalidImageError as exc:
        raise InvalidInputError(str(exc)) from None


def _level(config: ModelConfig, priority: int | None) -> int:
    if priority is not None and not 0 <= priority <= config.priority_levels:
        raise InvalidParameterError(
            f"priority must be between 0 (the default) and {config.priority_levels}"
        )
    return (priority or config.default_priority) - 1


def held_bytes(image: PreparedImage) -> int:
    """What a waiting image holds until its batch takes it: its encoded bytes (for a device
    decoder), its decoded crop, or the client's normalised tensor."""
    if image.data is not None:
        return len(image.data)
    tensor = image.pixels if image.pixels is not None else image.normalized
    return tensor.numel() * tensor.element_size() if tensor is not None else 0

"""What a front end hands the serving core for one request, and what it gets back.

A front end translates: it makes an ``InferenceRequest`` from its wire format (the model it
names, how to read its body within its bound, how to parse what was read, its deadline and
priority), makes one call, ``Predictor.infer``, and writes the ``InferenceResponse`` back in
its own format. Admission, reading, parsing, decoding, batching and the typed errors are the
core's; the front end's own knowledge (the protocol's outputs, a response id) travels through
the core untouched as ``Parsed.detail``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from app.engine import Prediction
from preprocessing import Buffer

__all__ = [
    "Body", "Cancelled", "InferenceRequest", "InferenceResponse", "Inputs", "ModelDescription",
    "ModelFacts", "Parsed", "Prediction", "Reserve",
]  # fmt: skip

Reserve = Callable[[int], None]


class Cancelled(Exception):
    """The caller went away while its request waited."""


@dataclass(frozen=True)
class Inputs:
    """What a request carries: ``encoded`` images (bytes each), ``pixels`` (UINT8
    ``[N, H, W, 3]``) or ``tensor`` (FP32 ``[N, 3, crop, crop]``, normalised)."""

    kind: Literal["encoded", "pixels", "tensor"]
    items: Sequence[Buffer] | np.ndarray[Any, Any]

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class ModelFacts:
    """What parsing may need to know: of the model that will answer, and of the limits."""

    classes: int  # the number of classes it ranks
    canvas: tuple[int, int] | None  # its input tensor's (height, width); None: each image's own
    max_images: int  # MAX_IMAGES_PER_REQUEST
    max_bytes: int  # MAX_IMAGE_BYTES: what one request may carry
    task: str = "classify"  # what it answers: classify, detect, segment, embed
    instances: tuple[str, ...] = ()  # what a detector gives beside its boxes


@dataclass(frozen=True)
class ModelDescription:
    """A serving model version, as the protocol's metadata describes it."""

    name: str
    versions: list[str]  # every version of it that serves
    backend: str  # what runs its forward pass
    classes: int
    canvas: tuple[int, int] | None  # its input tensor's (height, width); None: each image's own
    task: str = "classify"
    dimensions: int = 0  # an encoder's
    instances: tuple[str, ...] = ()  # what a detector gives beside its boxes


@dataclass
class Parsed:
    """A request's body read into what the core needs: its inputs, how many classes to rank
    and whether every class's probability is wanted, and what the body itself says of its
    deadline and priority. ``detail`` is the front end's own, given back with the answer."""

    inputs: Inputs
    top_k: int | None = None  # None: the model's TOP_K
    dense: bool = False
    timeout_s: float | None = None
    priority: int | None = None
    min_score: float | None = None  # a detector's (None: the model's MIN_SCORE)
    max_detections: int | None = None  # None: the model's MAX_DETECTIONS
    masks: bool | None = None  # an instance segmenter's masks (None: as the transport says)
    detail: Any = None


class Body(Protocol):
    """How the core reads a request's body: within ``limit`` bytes (``MAX_IMAGE_BYTES``), each
    chunk's running total told to ``reserve`` (which may refuse: admission counts the bytes as
    they arrive)."""

    async def read(self, reserve: Reserve, limit: int) -> Any: ...


@dataclass
class InferenceRequest:
    """One request, as every front end hands it over.

    ``parse(body, facts)`` turns what ``body.read`` returned into ``Parsed``; it runs in the
    parse threads when ``parse_off_loop`` (JSON, base64, tensors: seconds of CPU for a large
    body), else on the event loop (an image that is the whole body). ``timeout_s`` and
    ``priority`` are the transport's (a header, the call's deadline); the body may name its
    own, and the earlier deadline counts. ``cancelled()`` completes when the client goes away.
    ``named(model)`` is told which model answers as soon as it is known (for the metrics)."""

    model: str | None
    version: str | int | None
    body: Body
    parse: Callable[[Any, ModelFacts], Parsed]
    parse_off_loop: bool = True
    declared_bytes: int = 0
    timeout_s: float | None = None
    priority: int | None = None
    top_k: int | None = None
    min_score: float | None = None
    max_detections: int | None = None
    masks: bool = True  # an instance segmenter's masks (``?masks=false``: its boxes alone)
    cancelled: Callable[[], Awaitable[Any]] | None = None
    named: Callable[[str], None] | None = None
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class InferenceResponse:
    """The answer: which model and version gave it, one prediction per input image in order,
    the model's class count, the parse's ``detail``, and where the time went (seconds: the
    body's reading, its decoding, its wait for a batch, and the batch's own stages)."""

    model: str
    version: str
    predictions: list[Prediction]
    classes: int
    detail: Any
    timings: dict[str, float]
    observe_stage: Callable[[str, float], None]
    task: str = "classify"
    labels: Sequence[str] = ()  # the names of its classes, by index
    normalized: bool = False  # an encoder's vectors are of unit length
    instances: tuple[str, ...] = ()  # what a detector gives beside its boxes

    @property
    def batch_size(self) -> int:
        """How many requests shared the first image's forward pass."""
        return self.predictions[0].batch_size if self.predictions else 0

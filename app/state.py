"""What the routes share: the lifecycle, the engine, the batcher, admission and the metrics."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from app.admission import Admission
from app.engine import InferenceEngine, InferenceRequest, Prediction
from app.errors import NotReadyError
from app.lifecycle import Lifecycle
from app.metrics import Metrics
from app.settings import Settings
from batching import DynamicBatcher


@dataclass
class Serving:
    """The parts that exist once the model is loaded and the batcher runs."""

    engine: InferenceEngine
    batcher: DynamicBatcher[InferenceRequest, Prediction]
    admission: Admission
    decode_pool: ThreadPoolExecutor


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    serving: Serving | None = None
    active: int = 0  # prediction requests in progress
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()
        self.lifecycle.subscribe(self.metrics.on_phase)

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    def require_ready(self) -> Serving:
        """The serving parts, or ``NotReadyError`` (503 with ``Retry-After``)."""
        if not self.lifecycle.ready or self.serving is None:
            raise NotReadyError(self.lifecycle.reason, headers={"Retry-After": "1"})
        return self.serving


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state

"""What the routes share: the engine, the batcher, the metrics and the readiness flag."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from app.engine import InferenceEngine, InferenceRequest, Prediction
from app.errors import NotReadyError
from app.metrics import Metrics
from app.settings import Settings
from batching import DynamicBatcher


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    engine: InferenceEngine | None = None
    batcher: DynamicBatcher[InferenceRequest, Prediction] | None = None
    decode_pool: ThreadPoolExecutor | None = None
    ready: bool = False
    preparing: int = 0  # admitted /predict requests not yet in the batcher's queue
    active: int = 0  # /predict requests in progress
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    not_ready_reason: str = field(default="the model is loading")

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    def start_draining(self) -> None:
        self.ready = False
        self.not_ready_reason = "the server is draining"
        self.metrics.ready.set(0)

    def unready_reason(self) -> str | None:
        """Why ``/readyz`` answers 503 (None while ready)."""
        if not self.ready or self.batcher is None:
            return self.not_ready_reason
        if not self.batcher.accepting:
            return "the batcher has stopped"
        return None

    def require_ready(
        self,
    ) -> tuple[InferenceEngine, DynamicBatcher[InferenceRequest, Prediction], ThreadPoolExecutor]:
        reason = self.unready_reason()
        if reason is not None:
            raise NotReadyError(reason, headers={"Retry-After": "1"})
        assert self.engine is not None
        assert self.batcher is not None
        assert self.decode_pool is not None
        return self.engine, self.batcher, self.decode_pool


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state

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
    draining: bool = False
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
        self.draining = True
        self.ready = False
        self.not_ready_reason = "the server is draining"
        self.metrics.ready.set(0)

    @property
    def is_ready(self) -> bool:
        return self.ready and self.batcher is not None and self.batcher.accepting

    def require_ready(
        self,
    ) -> tuple[InferenceEngine, DynamicBatcher[InferenceRequest, Prediction], ThreadPoolExecutor]:
        if not self.is_ready:
            reason = self.not_ready_reason
            if self.batcher is not None and self.ready and not self.batcher.accepting:
                reason = "the batcher has stopped"
            raise NotReadyError(reason, headers={"Retry-After": "1"})
        assert self.engine is not None
        assert self.batcher is not None
        assert self.decode_pool is not None
        return self.engine, self.batcher, self.decode_pool


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state

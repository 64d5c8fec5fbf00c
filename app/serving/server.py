"""What every front end shares: the settings, the metrics, the lifecycle and the serving core,
and how many prediction requests are in progress (for the drain)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from app.errors import NotReadyError
from app.metrics import Metrics
from app.serving.lifecycle import Lifecycle
from app.serving.predict import Predictor
from app.settings import Settings
from app.startup import Phases


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    predictor: Predictor | None = None
    active: int = 0  # prediction requests in progress
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Process-wide start-up phases (the models' own are on their versions).
    startup: Phases = field(default_factory=Phases)

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

    def require_ready(self) -> Predictor:
        """The serving core, or ``NotReadyError`` (503 with ``Retry-After``)."""
        if not self.lifecycle.ready or self.predictor is None:
            raise NotReadyError(self.lifecycle.reason, headers={"Retry-After": "1"})
        return self.predictor

    def started(self) -> Predictor:
        """The serving core once it exists (also while draining), or ``NotReadyError``."""
        if self.predictor is None:
            raise NotReadyError(self.lifecycle.reason, headers={"Retry-After": "1"})
        return self.predictor

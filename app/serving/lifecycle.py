"""The server's one lifecycle state, read by every probe, route and gauge that cares."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

logger = logging.getLogger("batchserve")


class Phase(enum.StrEnum):
    STARTING = "starting"  # loading the model, warming up
    READY = "ready"  # serving
    DRAINING = "draining"  # finishing accepted work, refusing new work
    STOPPED = "stopped"  # drained and closed
    FAILED = "failed"  # cannot serve again: the process should be restarted


_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.READY, Phase.DRAINING, Phase.FAILED}),
    Phase.READY: frozenset({Phase.DRAINING, Phase.FAILED}),
    Phase.DRAINING: frozenset({Phase.STOPPED, Phase.FAILED}),
    Phase.STOPPED: frozenset(),
    Phase.FAILED: frozenset(),
}

_REASONS = {
    Phase.STARTING: "the model is loading",
    Phase.READY: "",
    Phase.DRAINING: "the server is draining",
    Phase.STOPPED: "the server has stopped",
}


class Lifecycle:
    """``starting -> ready -> draining -> stopped``, or ``failed`` from any live phase.

    - ready (``/readyz`` 200, new work accepted) only in ``ready``;
    - live (``/healthz`` 200) in every phase but ``failed``: a failed server cannot recover on
      its own, so the orchestrator's liveness probe must see it and restart the process.
      (``starting`` is seen by in-process callers only: uvicorn listens once the lifespan's
      start-up is over, so probes get refused connections until then.)

    Moves that make no sense (back to ``ready`` after draining, anything after ``stopped`` or
    ``failed``) are ignored, so that racing callers (SIGTERM, lifespan shutdown, a crashing
    batcher) cannot undo each other.
    """

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._reason = _REASONS[Phase.STARTING]
        self._listeners: list[Callable[[Phase], None]] = []

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def reason(self) -> str:
        """Why the server is not ready ("" while ready)."""
        return self._reason

    @property
    def ready(self) -> bool:
        return self._phase is Phase.READY

    @property
    def live(self) -> bool:
        return self._phase is not Phase.FAILED

    def subscribe(self, listener: Callable[[Phase], None]) -> None:
        """Call ``listener(phase)`` now and on every change."""
        self._listeners.append(listener)
        listener(self._phase)

    def serve(self) -> None:
        self._move(Phase.READY)

    def drain(self) -> None:
        self._move(Phase.DRAINING)

    def stop(self) -> None:
        self._move(Phase.STOPPED)

    def fail(self, reason: str) -> None:
        if self._move(Phase.FAILED, reason):
            logger.critical("%s: liveness now fails so that the process is restarted", reason)

    def _move(self, phase: Phase, reason: str | None = None) -> bool:
        if phase not in _NEXT[self._phase]:
            return False
        self._phase = phase
        self._reason = reason if reason is not None else _REASONS[phase]
        for listener in self._listeners:
            listener(phase)
        return True

"""Graceful drain on SIGTERM: stop admitting, finish what was accepted, then let uvicorn exit.

uvicorn's own SIGTERM handling closes the listening socket at once, so a load balancer probing
``/readyz`` sees refused connections rather than a 503, and a client racing the shutdown sees a
reset. We run first: readiness turns 503, new predictions get 503 ``not_ready`` (still over
HTTP), accepted ones finish (up to the drain timeout), and only then is uvicorn's handler
called to close the sockets and run the lifespan shutdown.

``DRAIN_TIMEOUT_S`` is one budget from SIGTERM to the end of the lifespan: the drain, the gRPC
server's stop and the models' unloading share it (``remaining_s``), so that the preStop pause,
the budget and uvicorn's own graceful shutdown add up to less than the pod's termination grace
period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from app.http.state import ServerState

logger = logging.getLogger("batchserve")


class SigtermDrain:
    """Owns SIGTERM while the app serves (only in the main thread, where signals arrive)."""

    def __init__(self, server: ServerState, timeout_s: float) -> None:
        self._server = server
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Any = None
        self._installed = False
        self._task: asyncio.Task[None] | None = None
        self._began: float | None = None  # when SIGTERM arrived (monotonic)

    def remaining_s(self) -> float:
        """What is left of the budget for the rest of the shutdown: counted from SIGTERM, or
        all of it when the shutdown did not begin with one."""
        if self._began is None:
            return self._timeout_s
        return max(0.0, self._timeout_s - (time.monotonic() - self._began))

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes of the main thread: only schedule the work.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.begin)

    def begin(self) -> None:
        """Start draining (idempotent)."""
        if self._task is not None:
            return
        self._began = time.monotonic()
        self._server.lifecycle.drain()
        logger.info("SIGTERM: draining %d request(s) in progress", self._server.active)
        self._task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await asyncio.wait_for(self._server.idle.wait(), self._timeout_s)
        except TimeoutError:
            logger.warning(
                "drain timeout (%.1fs): failing %d request(s) still in progress with 503",
                self._timeout_s,
                self._server.active,
            )
            # Answer what is left now, so that uvicorn need not wait for those connections.
            if self._server.predictor is not None:
                await self._server.predictor.registry.abort()
        self._hand_over()

    def _hand_over(self) -> None:
        previous = self._previous
        self.uninstall()
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signal.SIGTERM)  # default action: terminate

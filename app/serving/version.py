"""One loaded version of a model: its engine, its batcher, its metrics, and its state.

A version is built off the event loop (load, export or artefact, start-up check or INT8 gate,
warm-up), then serves; when it is replaced or unloaded it stops admitting, finishes every
request it accepted, closes its batcher and lets its engine go.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import threading
import time
import weakref
from typing import Any

from app.engine import ImageRequest, InferenceEngine, Prediction, build_engine
from app.engine.warmup import WARMUP_IMAGES, warmup_images
from app.first_try import FALLBACK
from app.metrics import VersionMetrics
from app.model_config import ModelConfig
from app.startup import Phases
from batching import DynamicBatcher, ExecutionTimeModel

logger = logging.getLogger("batchserve")


class VersionState(enum.StrEnum):
    """As Triton's repository index names them."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class ModelVersion:
    """A model version from loading to unloading. ``enter``/``leave`` count the requests it
    accepted, so that it is freed only after the last one is answered."""

    def __init__(
        self, model: str, version: int, config: ModelConfig, metrics: VersionMetrics
    ) -> None:
        self.model = model
        self.version = version
        self.config = config
        self.metrics = metrics
        self.state = VersionState.LOADING
        self.reason = "loading"
        self.engine: InferenceEngine | None = None
        self.batcher: DynamicBatcher[ImageRequest, Prediction] | None = None
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_failure: Any = None
        self.phases = Phases()  # how long each phase of its load took
        self._warming: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"{self.model}/{self.version}"

    @property
    def ready(self) -> bool:
        return self.state is VersionState.READY

    async def load(self, device_lock: threading.Lock | None, on_failure: Any = None) -> None:
        """Build, check (or gate) and warm up the engine, then start the batcher. Raises what
        the build raises; the version is then ``UNAVAILABLE``."""
        config = self.config
        batching = config.batch_config(_device_type(config))
        phases = self.phases
        try:
            build = asyncio.to_thread(
                build_engine, config, batching, self.metrics, device_lock=device_lock,
                phases=phases,
            )  # fmt: skip
            if config.backend == "torch":
                engine = await build
            else:
                # The warm-up's images are made on the other core while the runtime compiles,
                # which it does with the GIL released (loading TorchScript holds it).
                engine, _ = await asyncio.gather(
                    build, asyncio.to_thread(warmup_images, WARMUP_IMAGES)
                )
            first, later = warmup_sizes(config.warmup, engine)
            with phases.phase("warmup"):
                warmup = await asyncio.to_thread(engine.warmup, first)
        except BaseException as exc:
            self.state, self.reason = VersionState.UNAVAILABLE, f"failed to load: {exc}"
            raise
        if batching.serial_execution and not engine.backend.serialized:
            batching = dataclasses.replace(batching, serial_execution=False)
        batcher_started = time.perf_counter()
        timings = ExecutionTimeModel()
        for size, seconds in warmup.items():
            timings.observe(size, seconds)
        self.engine = engine
        self.batcher = DynamicBatcher(
            engine.run_batch,
            batching,
            observer=self.metrics,
            timings=timings,
            on_failure=lambda error: on_failure(self, error) if on_failure else None,
        )
        self.batcher.start()
        phases.add("batcher", time.perf_counter() - batcher_started)
        if later:
            self._warming = asyncio.create_task(self._warm_up_when_idle(later, timings))
        self.metrics.serving(
            engine.device, engine.precision, engine.backend.name, engine.weights,
            lambda: self.batcher.queue_depth if self.batcher else 0,
            lambda: self.batcher.inflight_batches if self.batcher else 0, engine.task,
            FALLBACK if self.config.choice else "",
        )  # fmt: skip
        self.state, self.reason = VersionState.READY, ""
        self.metrics.ready(True)
        logger.info(
            "serving %s: %s (%s weights) on %s in %s with %s %s; batches up to %d, window %.1f ms",
            self.name, engine.name, engine.weights, engine.device, engine.precision,
            engine.backend.name, engine.backend.variant, batching.max_batch_size,
            batching.max_queue_delay_s * 1000,
        )  # fmt: skip
        if self.config.choice:
            logger.warning("%s", self.config.choice)

    async def _warm_up_when_idle(self, sizes: tuple[int, ...], timings: ExecutionTimeModel) -> None:
        """The batch sizes not warmed before ready, one at a time, each only while nothing of
        this version waits or runs: a request arriving meanwhile waits for one warm-up batch
        at most."""
        for size in sizes:
            while True:
                batcher, engine = self.batcher, self.engine
                if batcher is None or engine is None:
                    return
                if batcher.queue_depth == 0 and batcher.inflight_batches == 0:
                    break
                await asyncio.sleep(0.05)
            # The thread pool's work item outlives the job by a moment: it holds only a weak
            # reference, so that an unload frees the engine as soon as the job is done.
            warming = asyncio.ensure_future(asyncio.to_thread(_warm, weakref.ref(engine), size))
            del engine
            try:
                measured = await asyncio.shield(warming)
            except asyncio.CancelledError:
                # A thread cannot be stopped, and it holds the engine until its batch is done:
                # an unload waits for that rather than leave the engine alive behind it.
                with contextlib.suppress(Exception):
                    await warming
                raise
            except Exception as exc:  # the engine serves on; the size warms up on first use
                logger.warning("%s: warming up batch size %d failed: %s", self.name, size, exc)
                return
            for each, seconds in measured.items():
                timings.observe(each, seconds)

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active <= 0:
            self._idle.set()

    async def unload(self, drain_timeout_s: float, reason: str = "unloaded") -> None:
        """Stop admitting, answer every accepted request (up to ``drain_timeout_s``; the rest
        get 503), close the batcher and free the engine."""
        if self.state is VersionState.UNAVAILABLE:
            return
        ends = time.monotonic() + drain_timeout_s  # one budget for the wait and the close
        self.state, self.reason = VersionState.UNLOADING, "unloading"
        self.metrics.ready(False)
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            logger.warning("%s: %d request(s) still in progress after %.1f s: answering 503",
                           self.name, self.active, drain_timeout_s)  # fmt: skip
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming  # at most the one warm-up batch already running
        if self.batcher is not None:
            await self.batcher.aclose(max(0.0, ends - time.monotonic()))
        self.batcher = None
        self.engine = None
        # Reference counting frees the engine's tensors and runtime sessions now; the
        # registry collects what is left in cycles once nothing is being served.
        self.state, self.reason = VersionState.UNAVAILABLE, reason
        logger.info("%s %s", self.name, reason)

    def describe(self) -> dict[str, Any]:
        return {"name": self.model, "version": str(self.version), "state": self.state.value,
                "reason": self.reason}  # fmt: skip


def _warm(engine: weakref.ref[InferenceEngine], size: int) -> dict[int, float]:
    """Warm up one batch size of the engine, if it still exists."""
    alive = engine()
    return alive.warmup((size,)) if alive is not None else {}


def warmup_sizes(choice: str, engine: InferenceEngine) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The batch sizes to warm up before ready, and after.

    ``all`` (``auto`` on CUDA, where CUDA graphs and autotuning want every bucket first): every
    bucket before. ``first`` (``auto`` on a CPU): the smallest before, which is what an idle
    server's first request runs at; the larger ones cost seconds on a CPU (a batch of 32
    resnet50 images, twice) and would only delay ready.
    """
    buckets = engine.buckets
    if choice == "all" or (choice == "auto" and engine.device.type == "cuda"):
        return buckets, ()
    return buckets[:1], buckets[1:]


def _device_type(config: ModelConfig) -> str:
    from app.engine import resolve_device

    return resolve_device(config.device, config.worker_index).type

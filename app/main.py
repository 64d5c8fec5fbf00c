"""The application factory and its lifespan: load, warm up, serve, drain."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from app.admission import Admission
from app.auth import require_api_key
from app.cpus import pin_worker
from app.draining import SigtermDrain
from app.engine import DeviceError, ModelLoadError, StartupError, build_engine, resolve_device
from app.errors import install_error_handlers
from app.limits import HeaderLimitMiddleware
from app.logs import configure_logging
from app.metrics import Metrics
from app.outcomes import OutcomeMiddleware
from app.requestid import RequestIdMiddleware
from app.routes import health, metrics, models, predict, v2
from app.settings import Settings, SettingsError, load_settings
from app.state import ServerState, Serving
from batching import DynamicBatcher, ExecutionTimeModel

logger = logging.getLogger("batchserve")

_V2_INFER = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")


def prediction_route(path: str) -> str | None:
    """The name of a prediction route, for ``batchserve_requests_total{route}``."""
    if path == "/predict":
        return "predict"
    if _V2_INFER.fullmatch(path):
        return "v2_infer"
    return None


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Nothing heavy happens here: the model loads in the lifespan."""
    if settings is None:
        try:
            settings = load_settings()
        except SettingsError as exc:
            raise SystemExit(f"batchserve: {exc}") from None
    configure_logging(settings.log_level, settings.log_json)
    server = ServerState(settings, Metrics())

    app = FastAPI(
        title="batchserve",
        summary="Dynamic-batching inference for PyTorch vision models",
        version="0.1.0",
        lifespan=_lifespan(server),
    )
    app.state.server = server
    install_error_handlers(app)
    # Authentication is wired here and only here: a protected route checks the key before
    # anything of the request (parameters included) is looked at.
    protected = [Depends(require_api_key)]
    app.include_router(predict.router, dependencies=protected)
    app.include_router(models.router, dependencies=protected)
    app.include_router(v2.router, dependencies=protected)
    app.include_router(metrics.router, dependencies=protected if settings.protect_metrics else [])
    app.include_router(health.router)
    app.include_router(v2.health)
    Instrumentator(
        registry=server.metrics.registry,
        excluded_handlers=[
            "/metrics",
            "/healthz",
            "/readyz",
            "/v2/health/live",
            "/v2/health/ready",
        ],
    ).instrument(app)
    app.add_middleware(RequestIdMiddleware)  # ids and start times for everything below
    app.add_middleware(HeaderLimitMiddleware, max_bytes=settings.max_header_bytes)
    app.add_middleware(
        OutcomeMiddleware, route_of=prediction_route, count=server.metrics.count_request
    )
    return app


def _lifespan(server: ServerState):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings, metrics, lifecycle = server.settings, server.metrics, server.lifecycle
        share = pin_worker(settings.worker_index, settings.workers)
        if share is not None:
            logger.info("worker %d of %d: CPUs %s", settings.worker_index, settings.workers, share)
        config = settings.batch_config(resolve_device(settings.device, settings.worker_index).type)
        # Loading and warm-up take seconds: keep them off the event loop.
        try:
            engine = await asyncio.to_thread(build_engine, settings, config, metrics)
            warmup = await asyncio.to_thread(engine.warmup)
        except (StartupError, ModelLoadError, DeviceError) as exc:
            logger.critical("batchserve cannot start: %s", exc)
            raise
        timings = ExecutionTimeModel()
        for size, seconds in warmup.items():
            timings.observe(size, seconds)
        batcher = DynamicBatcher(
            engine.run_batch,
            config,
            observer=metrics,
            timings=timings,
            on_failure=lambda error: lifecycle.fail("the batching loop failed"),
        )
        batcher.start()
        admission = Admission(batcher, config.max_queue_size, settings.max_queue_bytes)
        metrics.track(
            lambda: batcher.queue_depth,
            lambda: batcher.inflight_batches,
            lambda: admission.bytes,
            lambda: admission.requests,
        )
        metrics.limits(config.max_queue_size, settings.max_queue_bytes)
        metrics.model_info.labels(
            engine.name, str(engine.device), engine.precision, engine.backend.name
        ).set(1)
        if engine.device.type == "cuda":
            metrics.track_cuda(engine.device)
        decode_pool = ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="decode")
        server.serving = Serving(engine, batcher, admission, decode_pool)
        lifecycle.serve()
        drain = SigtermDrain(server, settings.drain_timeout_s)
        drain.install()
        logger.info(
            "serving %s (%s weights) on %s in %s with %s %s; batches up to %d, window %.1f ms",
            engine.name,
            engine.weights,
            engine.device,
            engine.precision,
            engine.backend.name,
            engine.backend.variant,
            config.max_batch_size,
            config.max_queue_delay_s * 1000,
        )
        try:
            yield
        finally:
            drain.uninstall()
            lifecycle.drain()
            await batcher.aclose(settings.drain_timeout_s)
            decode_pool.shutdown(wait=False, cancel_futures=True)
            lifecycle.stop()
            logger.info("stopped")

    return lifespan


app = create_app()

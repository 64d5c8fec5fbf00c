"""The application factory and its lifespan: load, warm up, serve, drain."""

from __future__ import annotations

# ruff: noqa: E402 - collection is deferred before the imports below (torch above all) run.
from app import heap

heap.defer_collection()

import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from app.cpus import pin_worker
from app.errors import ServiceError
from app.http.auth import require_api_key
from app.http.direct import DirectRoute, DirectRoutes, route_named
from app.http.draining import SigtermDrain
from app.http.errors import install_error_handlers
from app.http.limits import HeaderLimitMiddleware
from app.http.outcomes import OutcomeMiddleware
from app.http.requestid import RequestIdMiddleware
from app.http.routes import health, metrics, models, predict, repository, v2
from app.http.state import ServerState
from app.logs import configure_logging
from app.metrics import Metrics
from app.serving.admission import Admission
from app.serving.predict import PARSE_THREADS, Predictor
from app.serving.registry import Registry
from app.settings import Settings, SettingsError, load_settings
from app.startup import Phases, process_age_s
from batching.threads import LoopThreads

logger = logging.getLogger("batchserve")

PREDICTION_ROUTES = (
    DirectRoute("predict", re.compile("/predict"), predict.handle),
    DirectRoute(
        "v2_infer",
        re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer"),
        v2.handle_infer,
    ),
)


def prediction_route(path: str) -> str | None:
    """The name of a prediction route, for ``batchserve_requests_total{route}``."""
    return route_named(PREDICTION_ROUTES, path)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Nothing heavy happens here: the model loads in the lifespan."""
    startup = Phases()
    startup.add("imports", process_age_s() or 0.0)
    if settings is None:
        with startup.phase("settings"):
            try:
                settings = load_settings()
            except SettingsError as exc:
                raise SystemExit(f"batchserve: {exc}") from None
    configure_logging(settings.log_level, settings.log_json)
    server = ServerState(settings, Metrics(), startup=startup)

    app = FastAPI(
        title="batchserve",
        summary="Dynamic-batching inference for PyTorch vision models",
        version="0.1.0",
        lifespan=_lifespan(server),
    )
    app.state.server = server
    install_error_handlers(app)
    # Authentication is wired here: a protected route checks the key before anything of the
    # request (parameters included) is looked at. ``/predict`` checks it itself, first, since
    # its route skips FastAPI's per-request dependency solving (``PredictRoute``).
    protected = [Depends(require_api_key)]
    app.include_router(predict.router)
    app.include_router(models.router, dependencies=protected)
    app.include_router(v2.router, dependencies=protected)
    app.include_router(repository.router, dependencies=protected)
    app.include_router(metrics.router, dependencies=protected if settings.protect_metrics else [])
    app.include_router(health.router)
    app.include_router(v2.health)
    Instrumentator(
        registry=server.metrics.registry,
        # The prediction routes have batchserve_requests_total and
        # batchserve_request_duration_seconds (OutcomeMiddleware), at a fraction of the cost.
        excluded_handlers=[
            "^/predict$",
            "^/v2/models/.+/infer$",
            "/metrics",
            "/healthz",
            "/readyz",
            "/v2/health/live",
            "/v2/health/ready",
        ],
    ).instrument(app)
    # The prediction routes skip the router, the instrumentator and the exception middleware.
    app.add_middleware(DirectRoutes, routes=PREDICTION_ROUTES)
    app.add_middleware(RequestIdMiddleware)  # ids and start times for everything below
    app.add_middleware(HeaderLimitMiddleware, max_bytes=settings.max_header_bytes)
    app.add_middleware(
        OutcomeMiddleware, route_of=prediction_route, count=server.metrics.count_request
    )
    heap.freeze()  # the imports and the application: everything so far lives as long as it
    return app


def _lifespan(server: ServerState):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings, metrics, lifecycle = server.settings, server.metrics, server.lifecycle
        lifespan_started = time.perf_counter()
        share = pin_worker(settings.worker_index, settings.workers)
        if share is not None:
            logger.info("worker %d of %d: CPUs %s", settings.worker_index, settings.workers, share)
        admission = Admission(settings.max_queue_size, settings.max_queue_bytes)
        metrics.track(lambda: admission.bytes, lambda: admission.requests)
        metrics.limits(settings.max_queue_size, settings.max_queue_bytes)
        registry = Registry(settings, metrics, admission, on_failure=lifecycle.fail)
        # Loading and warm-up take seconds: the registry keeps them off the event loop.
        try:
            for name in initial_models(settings, registry):
                await registry.load(name)
        except ServiceError as exc:
            logger.critical("batchserve cannot start: %s", exc.message)
            await registry.aclose()
            raise
        decode_threads = LoopThreads(settings.decode_threads, "decode")
        parse_threads = LoopThreads(PARSE_THREADS, "parse")
        server.predictor = Predictor(
            settings, registry, admission, metrics, decode_threads, parse_threads
        )
        grpc_front = None
        if settings.grpc_port:
            from app.grpc.server import GrpcBindError, GrpcFrontEnd

            grpc_front = GrpcFrontEnd(server, app.version)
            try:
                await grpc_front.start()
            except GrpcBindError as exc:
                logger.critical("batchserve cannot start: %s", exc)
                await registry.aclose()
                decode_threads.shutdown()
                parse_threads.shutdown()
                raise
        lifecycle.serve()
        _report_startup(server, registry, time.perf_counter() - lifespan_started)
        drain = SigtermDrain(server, settings.drain_timeout_s)
        drain.install()
        try:
            yield
        finally:
            drain.uninstall()
            lifecycle.drain()
            # What is left of DRAIN_TIMEOUT_S since SIGTERM: after its drain, little is left
            # to wait for, and the whole shutdown must fit in the pod's grace period.
            if grpc_front is not None:
                await grpc_front.stop(drain.remaining_s())
            await registry.aclose(drain.remaining_s())
            decode_threads.shutdown()
            parse_threads.shutdown()
            lifecycle.stop()
            heap.thaw()
            logger.info("stopped")

    return lifespan


def _report_startup(server: ServerState, registry: Registry, lifespan_s: float) -> None:
    """Start-up by phase, logged and in the metrics: the process's, then its models' own."""
    startup = server.startup
    models = Phases()
    for versions in registry.models.values():
        for version in versions.values():
            models.merge(version.phases)
    startup.add("server", max(0.0, lifespan_s - sum(models.seconds.values())))
    startup.merge(models)
    ready = process_age_s()
    if ready is not None:
        startup.add("ready", ready)
    server.metrics.started(startup.seconds)
    logger.info("ready in %s", ", ".join(f"{k} {v:.2f} s" for k, v in startup.seconds.items()))


def initial_models(settings: Settings, registry: Registry) -> list[str]:
    """The models loaded at start: every one, or ``LOAD_MODELS`` under explicit control."""
    if settings.model_control == "explicit" and settings.load_models:
        return list(settings.load_models)
    return registry.available()


app = create_app()

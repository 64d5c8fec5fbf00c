"""``GET /v1/models``: what is served, and how."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.engine.int8.int8_class import this_cpu
from app.http.responses import json_response
from app.http.schemas import ModelList
from app.http.state import ServerState, server_state
from app.serving.version import ModelVersion

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    """Every loaded model version and how it serves, and every model of the repository with
    each version's state (``LOADING``, ``READY``, ``UNLOADING``, ``UNAVAILABLE``)."""
    server = server_state(request)
    registry = server.started().registry
    entries = [
        _describe(server, version)
        for _, versions in sorted(registry.models.items())
        for _, version in sorted(versions.items())
        if version.engine is not None and version.batcher is not None
    ]
    return json_response({"models": entries, "repository": registry.index()})


def _describe(server: ServerState, version: ModelVersion) -> dict[str, Any]:
    engine, batcher = version.engine, version.batcher
    assert engine is not None
    assert batcher is not None
    batching, settings = batcher.config, version.config
    transform = engine.transform
    cpu = this_cpu()
    return {
        "model": version.model,
        "version": str(version.version),
        "architecture": engine.name,
        # Deprecated: the architecture's old name, kept for one release beside ``architecture``.
        "name": engine.name,
        "weights": engine.weights,
        "choice": settings.choice,
        "device": str(engine.device),
        "precision": engine.precision,
        "state": server.lifecycle.phase.value if version.ready else version.state.value,
        "version_state": version.state.value,
        "backend": engine.backend.describe(),
        "check": engine.check,
        "cpu": {"int8_class": cpu.name, "int8_saturates": cpu.saturates},
        "threads": {
            "forward": settings.threads,
            "torch_in_batches": engine.torch_threads,
            "decode": server.settings.decode_threads,
        },
        "task": engine.task,
        "input_shape": list(engine.input_shape),
        "letterbox": transform.letterbox,
        "transform": transform.as_dict(),
        "resize_size": transform.resize_size,
        "num_classes": engine.num_classes,
        "mean": list(transform.mean),
        "std": list(transform.std),
        "interpolation": transform.interpolation.value,
        "batching": {
            "max_batch_size": batching.max_batch_size,
            "max_queue_delay_ms": batching.max_queue_delay_s * 1000,
            "preferred_batch_sizes": list(batching.preferred_batch_sizes),
            "max_queue_size": server.settings.max_queue_size,
            "max_queue_bytes": server.settings.max_queue_bytes,
            "max_inflight_batches": batching.max_inflight_batches,
            "latency_slo_ms": settings.latency_slo_ms,
            "dispatch_when_idle": batching.dispatch_when_idle,
            "request_timeout_ms": settings.request_timeout_ms,
        },
        "startup_s": {"model": version.phases.rounded(), "process": server.startup.rounded()},
        "warmup_ms": {
            str(size): round(seconds * 1000, 3) for size, seconds in engine.warmup_timings.items()
        },
    }

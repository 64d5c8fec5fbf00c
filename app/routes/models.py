"""``GET /v1/models``: what is served, and how."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.engine.int8_class import this_cpu
from app.errors import NotReadyError
from app.responses import json_response
from app.schemas import ModelList
from app.state import server_state

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> Response:
    server = server_state(request)
    serving = server.serving
    if serving is None:
        raise NotReadyError(server.lifecycle.reason, headers={"Retry-After": "1"})
    engine, batching, settings = serving.engine, serving.batcher.config, server.settings
    transform = engine.transform
    cpu = this_cpu()
    info = {
        "name": engine.name,
        "weights": engine.weights,
        "device": str(engine.device),
        "precision": engine.precision,
        "state": server.lifecycle.phase.value,
        "backend": engine.backend.describe(),
        "check": engine.check,
        "cpu": {"int8_class": cpu.name, "int8_saturates": cpu.saturates},
        "input_shape": list(engine.input_shape),
        "resize_size": transform.resize_size,
        "num_classes": engine.num_classes,
        "mean": list(transform.mean),
        "std": list(transform.std),
        "interpolation": transform.interpolation.value,
        "batching": {
            "max_batch_size": batching.max_batch_size,
            "max_queue_delay_ms": batching.max_queue_delay_s * 1000,
            "preferred_batch_sizes": list(batching.preferred_batch_sizes),
            "max_queue_size": batching.max_queue_size,
            "max_queue_bytes": serving.admission.max_bytes,
            "max_inflight_batches": batching.max_inflight_batches,
            "latency_slo_ms": settings.latency_slo_ms,
            "dispatch_when_idle": batching.dispatch_when_idle,
            "request_timeout_ms": settings.request_timeout_ms,
        },
        "warmup_ms": {
            str(size): round(seconds * 1000, 3) for size, seconds in engine.warmup_timings.items()
        },
    }
    return json_response({"models": [info]})

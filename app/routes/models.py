"""``GET /v1/models``: what is served, and how."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.auth import require_api_key
from app.errors import NotReadyError
from app.responses import json_response
from app.schemas import ModelList
from app.state import server_state

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_api_key)])
async def list_models(request: Request) -> Response:
    server = server_state(request)
    engine = server.engine
    if engine is None:
        raise NotReadyError(server.not_ready_reason)
    settings = server.settings
    batching = server.batcher.config if server.batcher else settings.batch_config()
    transform = engine.transform
    info = {
        "name": engine.name,
        "weights": engine.weights,
        "device": str(engine.device),
        "precision": engine.precision,
        "compile": engine.compile_mode,
        "cuda_graphs": bool(engine.graph_buckets),
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

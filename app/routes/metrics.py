"""``GET /metrics`` in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from app.auth import require_api_key
from app.state import server_state

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    server = server_state(request)
    if server.settings.protect_metrics:
        require_api_key(request)
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

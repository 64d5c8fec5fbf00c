"""``GET /metrics`` in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from app.http.state import server_state

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    registry = server_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.responses import json_response
from app.schemas import Status
from app.state import server_state

router = APIRouter()


@router.get("/healthz", response_model=Status, summary="200 while the process lives")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get(
    "/readyz",
    response_model=Status,
    responses={503: {"model": Status, "description": "loading, draining, or the batcher failed"}},
    summary="200 once warmed up and serving",
)
async def readyz(request: Request) -> Response:
    reason = server_state(request).unready_reason()
    if reason is None:
        return json_response({"status": "ready"})
    return json_response({"status": "not_ready", "reason": reason}, status_code=503)

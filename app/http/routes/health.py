"""Liveness and readiness, both read from the server's one lifecycle state."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.http.responses import json_response
from app.http.schemas import Status
from app.http.state import server_state
from app.serving.lifecycle import Lifecycle

router = APIRouter()


def _probe(lifecycle: Lifecycle, passing: bool, good: str, bad: str) -> Response:
    if passing:
        return json_response({"status": good, "state": lifecycle.phase.value})
    body = {"status": bad, "state": lifecycle.phase.value, "reason": lifecycle.reason}
    return json_response(body, status_code=503)


@router.get(
    "/healthz",
    response_model=Status,
    responses={503: {"model": Status, "description": "failed: the process must be restarted"}},
    summary="200 while the process can serve, now or after loading; 503 once it cannot",
)
async def healthz(request: Request) -> Response:
    lifecycle = server_state(request).lifecycle
    return _probe(lifecycle, lifecycle.live, "ok", "failed")


@router.get(
    "/readyz",
    response_model=Status,
    responses={503: {"model": Status, "description": "starting, draining, stopped or failed"}},
    summary="200 once warmed up and serving",
)
async def readyz(request: Request) -> Response:
    lifecycle = server_state(request).lifecycle
    return _probe(lifecycle, lifecycle.ready, "ready", "not_ready")

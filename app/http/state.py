"""The server state of the app a request belongs to."""

from __future__ import annotations

from fastapi import Request

from app.serving.server import ServerState

__all__ = ["ServerState", "server_state"]


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state

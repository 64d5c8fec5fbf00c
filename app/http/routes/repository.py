"""The model repository extension of the Open Inference Protocol, as Triton defines it.

``POST /v2/repository/index`` lists every model of the repository and the state of each
version (``READY``, ``LOADING``, ``UNLOADING``, ``UNAVAILABLE``); ``POST
/v2/repository/models/{name}/load`` loads a model or reloads it (its config and versions read
again; the new versions serve once built, checked and warmed up, the old ones finish what they
accepted); ``POST /v2/repository/models/{name}/unload`` stops serving it once its accepted
requests are answered. Loading and unloading need ``MODEL_CONTROL=explicit``.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.errors import BadRequestError
from app.http.body import read_raw
from app.http.responses import json_response
from app.http.state import ServerState, server_state
from app.serving.repository import refuse_without_control

MAX_BODY_BYTES = 64 * 1024
router = APIRouter(prefix="/v2/repository", tags=["Model repository (Triton extension)"])


@router.post("/index", summary="Every model and the state of each version")
async def index(request: Request) -> Response:
    await _parameters(request)
    return json_response(server_state(request).started().registry.index())


@router.post("/models/{name}/load", summary="Load or reload a model")
async def load(request: Request, name: str) -> Response:
    server = _controlled(request)
    if await _parameters(request):
        raise BadRequestError(
            "this server loads models from its repository: a config or files in the request "
            "are not supported"
        )
    await server.started().registry.load(name)
    return Response(status_code=200)


@router.post("/models/{name}/unload", summary="Unload a model")
async def unload(request: Request, name: str) -> Response:
    server = _controlled(request)
    await _parameters(request)  # unload_dependents: a model here has no dependents
    await server.started().registry.unload(name)
    return Response(status_code=200)


def _controlled(request: Request) -> ServerState:
    server = server_state(request)
    refuse_without_control(server.settings)
    return server


async def _parameters(request: Request) -> dict[str, Any]:
    """The request's ``parameters`` (an empty body, as Triton's client sends for the index,
    is none)."""
    body = bytes(await read_raw(request, MAX_BODY_BYTES))
    if not body.strip():
        return {}
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequestError("the body is not JSON") from None
    parameters = document.get("parameters", {}) if isinstance(document, dict) else None
    if not isinstance(parameters, dict):
        raise BadRequestError("'parameters' must be an object")
    return parameters

"""JSON responses rendered by orjson."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse, Response


class ORJSONResponse(JSONResponse):
    """A ``JSONResponse`` serialised with orjson (several times faster than ``json``)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return ORJSONResponse(content, status_code=status_code, headers=headers)

"""The prediction routes' direct dispatch: which requests it takes, and what it answers."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from app.errors import UnauthorizedError
from app.http.direct import DirectRoute, DirectRoutes, route_named
from app.main import PREDICTION_ROUTES
from tests import images
from tests.conftest import make_settings, serve


class FakeApp:
    """The rest of the application: answers 418 and remembers what reached it."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await PlainTextResponse("the router", status_code=418)(scope, receive, send)


def dispatch(handle: object) -> tuple[DirectRoutes, FakeApp, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    async def handler(request: Request, params: dict[str, str]) -> Response:
        seen.append(params)
        if isinstance(handle, BaseException):
            raise handle
        return PlainTextResponse(f"direct {request.url.path}")

    pattern = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
    inner = FakeApp()
    return DirectRoutes(inner, [DirectRoute("infer", pattern, handler)]), inner, seen


async def test_post_to_a_route_runs_its_handler_with_the_path_params() -> None:
    routes, inner, seen = dispatch(None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(routes), base_url="http://t") as c:
        plain = await c.post("/v2/models/m/infer")
        versioned = await c.post("/v2/models/m/versions/3/infer")
    assert (plain.status_code, plain.text) == (200, "direct /v2/models/m/infer")
    assert versioned.status_code == 200
    assert seen == [{"name": "m"}, {"name": "m", "version": "3"}]
    assert inner.paths == []


async def test_other_methods_and_paths_go_on_to_the_app() -> None:
    routes, inner, seen = dispatch(None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(routes), base_url="http://t") as c:
        answers = [
            await c.get("/v2/models/m/infer"),
            await c.post("/v2/models/m/infer/"),
            await c.post("/v2/models/a/b/infer"),
            await c.post("/v2/models/m"),
        ]
    assert [answer.status_code for answer in answers] == [418] * 4
    assert inner.paths == [("GET", "/v2/models/m/infer"), ("POST", "/v2/models/m/infer/"),
                           ("POST", "/v2/models/a/b/infer"), ("POST", "/v2/models/m")]  # fmt: skip
    assert seen == []


async def test_errors_raised_by_a_handler_are_answered_in_the_routes_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routes, _, _ = dispatch(UnauthorizedError("a valid API key is required"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(routes), base_url="http://t") as c:
        refused = await c.post("/v2/models/m/infer")
    assert refused.status_code == 401
    assert refused.json() == {"error": "a valid API key is required"}  # the protocol's shape

    routes, _, _ = dispatch(RuntimeError("secret detail"))
    with caplog.at_level(logging.ERROR, logger="batchserve"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(routes),
                                     base_url="http://t") as c:  # fmt: skip
            failed = await c.post("/v2/models/m/infer")
    assert failed.status_code == 500
    assert "secret detail" not in failed.text
    assert "Traceback" not in failed.text
    assert "secret detail" in caplog.text  # logged, not answered


def test_the_prediction_routes_are_named_for_their_metrics() -> None:
    assert route_named(PREDICTION_ROUTES, "/predict") == "predict"
    assert route_named(PREDICTION_ROUTES, "/v2/models/m/infer") == "v2_infer"
    assert route_named(PREDICTION_ROUTES, "/v2/models/m/versions/1/infer") == "v2_infer"
    assert route_named(PREDICTION_ROUTES, "/v2/models/m/ready") is None
    assert route_named(PREDICTION_ROUTES, "/predicted") is None


async def test_the_app_answers_predictions_without_its_router() -> None:
    """The app's router never sees a prediction: a route that would answer 418 in its place
    goes unused, while other methods on the same path still reach FastAPI (405)."""
    async with serve(make_settings()) as (app, client):

        @app.post("/predict", include_in_schema=False)
        async def shadow() -> Response:  # pragma: no cover - must never run
            return PlainTextResponse("the router", status_code=418)

        app.router.routes.insert(0, app.router.routes.pop())  # ahead of the real route
        answered = await client.post("/predict", content=images.jpeg(),
                                     headers={"content-type": "image/jpeg"})  # fmt: skip
        wrong_method = await client.get("/predict")
    assert answered.status_code == 200, answered.text
    assert wrong_method.status_code == 405


async def test_under_a_root_path_the_routes_are_matched_below_it() -> None:
    routes, inner, seen = dispatch(None)
    transport = httpx.ASGITransport(routes, root_path="/api")
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        mounted = await c.post("/api/v2/models/m/infer")
        outside = await c.post("/other/v2/models/m/infer")
    assert mounted.status_code == 200
    assert seen == [{"name": "m"}]
    assert outside.status_code == 418
    assert inner.paths == [("POST", "/other/v2/models/m/infer")]

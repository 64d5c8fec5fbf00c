"""Shared fixtures: settings for tiny models, the real app with its lifespan, an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from app.main import create_app
from app.settings import Settings

COLOR_MODEL = "tests.models:color_classifier"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never read a developer's .env or BATCHSERVE_* variables by accident."""
    import os

    for name in list(os.environ):
        if name.startswith("BATCHSERVE_"):
            monkeypatch.delenv(name)
    # SHARDS=auto measures a model whole and in parts at every fresh start (1.6 s of each
    # uvicorn process's start here): only where a test asks for it, as ``make_settings`` does.
    monkeypatch.setenv("BATCHSERVE_SHARDS", "1")
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "model": COLOR_MODEL,
        "weights": "none",
        "precision": "fp32",
        "max_batch_size": 8,
        "max_queue_delay_ms": 5,
        "decode_workers": 2,
        "drain_timeout_s": 5,
        "grpc_port": 0,  # in-process apps share one machine: gRPC only where a test asks
        "backend": "torch",  # BACKEND=auto measures every runtime: only where a test asks
        "shards": 1,  # SHARDS=auto measures the backend twice: only where a test asks
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)


@asynccontextmanager
async def serve(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The real app, its lifespan run, and a client talking ASGI to it."""
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=120, shutdown_timeout=60) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield app, client


async def served_photos(
    settings: Settings, query: str = ""
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model ``settings`` serve, described by ``/v1/models``, and its ``/predict`` answers
    to the test photos (``harness.photos``), sent together (with ``query``)."""
    from harness.photos import photos

    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        responses = await asyncio.gather(*(
            client.post(f"/predict{query}", content=photo, headers={"content-type": "image/png"})
            for photo in photos()
        ))  # fmt: skip
    for response in responses:
        assert response.status_code == 200, response.text
    return model, [response.json() for response in responses]


@pytest.fixture
def settings_factory() -> Callable[..., Settings]:
    return make_settings


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serve(make_settings()) as (_, http):
        yield http

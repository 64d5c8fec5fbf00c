"""The collector stays off the long-lived heap: no collections while the server's imports
run, what start-up made is frozen, and an unloaded model's objects are still freed."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from app import heap
from app.engine import InferenceEngine
from tests import images
from tests.conftest import COLOR_MODEL, make_settings, serve
from tests.fakes import until
from tests.repository import colour_repository

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_server_collects_nothing_until_the_app_exists() -> None:
    script = (
        "import gc, json, app.main\n"
        "print(json.dumps({'enabled': gc.isenabled(), 'frozen': gc.get_freeze_count(),"
        " 'full_collections': gc.get_stats()[2]['collections']}))\n"
    )
    env = {**os.environ, "BATCHSERVE_MODEL": COLOR_MODEL, "BATCHSERVE_WEIGHTS": "none"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    state = json.loads(done.stdout.strip().splitlines()[-1])
    # torch's import alone makes enough objects for several full collections.
    assert state["full_collections"] == 0
    assert state["enabled"]
    assert state["frozen"] > 100_000  # the imports and the app module's application


async def test_a_loaded_model_is_frozen_and_freed_once_unloaded(tmp_path: Path) -> None:
    settings = make_settings(model_repository=colour_repository(tmp_path),
                             model_control="explicit", load_models=("probe",))  # fmt: skip
    async with serve(settings) as (app, client):
        loaded = await client.post("/v2/repository/models/colors/load", json={})
        assert loaded.status_code == 200, loaded.text
        registry = app.state.server.started().registry
        engine = registry.models["colors"][2].engine
        assert engine is not None
        assert not any(tracked is engine for tracked in gc.get_objects())  # frozen, not tracked
        retired = weakref.ref(engine)
        del engine
        unloaded = await client.post("/v2/repository/models/colors/unload")
        assert unloaded.status_code == 200, unloaded.text
        assert retired() is None  # collected without the test asking for a collection
    assert gc.get_freeze_count() == 0  # the stopped server thawed the heap


async def test_an_unload_during_a_warm_up_after_ready_still_frees_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warming = threading.Event()
    warmup = InferenceEngine.warmup

    def slow_warmup(
        self: InferenceEngine, batch_sizes: tuple[int, ...] | None = None, rounds: int = 2
    ) -> dict[int, float]:
        if batch_sizes is not None and 1 not in batch_sizes:  # the sizes warmed after ready
            warming.set()
            time.sleep(0.5)  # the unload arrives while this thread holds the engine
        return warmup(self, batch_sizes, rounds)

    monkeypatch.setattr(InferenceEngine, "warmup", slow_warmup)
    settings = make_settings(model_repository=colour_repository(tmp_path),
                             model_control="explicit", load_models=("probe",))  # fmt: skip
    async with serve(settings) as (app, client):
        loaded = await client.post("/v2/repository/models/colors/load", json={})
        assert loaded.status_code == 200, loaded.text
        engine = app.state.server.started().registry.models["colors"][2].engine
        retired = weakref.ref(engine)
        del engine
        await asyncio.to_thread(warming.wait, 10)
        unloaded = await client.post("/v2/repository/models/colors/unload")
        assert unloaded.status_code == 200, unloaded.text
        assert retired() is None


async def test_a_reload_under_traffic_collects_only_once_nothing_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full collection after a reload holds the GIL for tenths of a second: it waits for
    a moment when no model has a request admitted, queued or computing."""
    settings = make_settings(model_repository=colour_repository(tmp_path),
                             model_control="explicit", load_models=("colors",))  # fmt: skip
    busy_when_collected: list[int] = []
    async with serve(settings) as (app, client):
        admission = app.state.server.started().admission
        collect = heap.collect_and_freeze

        def recorded() -> None:
            busy_when_collected.append(admission.requests)
            collect()

        monkeypatch.setattr(heap, "collect_and_freeze", recorded)
        stop = asyncio.Event()
        photo = images.jpeg()

        async def traffic() -> None:
            while not stop.is_set():
                answer = await client.post("/predict", content=photo,
                                           headers={"content-type": "image/jpeg"})  # fmt: skip
                assert answer.status_code == 200, answer.text

        clients = [asyncio.create_task(traffic()) for _ in range(8)]
        await asyncio.sleep(0.2)
        reloaded = await client.post("/v2/repository/models/colors/load")
        assert reloaded.status_code == 200, reloaded.text
        await asyncio.sleep(0.5)
        assert busy_when_collected == []  # not while the clients keep it busy
        stop.set()
        await asyncio.gather(*clients)
        await until(lambda: bool(busy_when_collected))
    assert busy_when_collected == [0]

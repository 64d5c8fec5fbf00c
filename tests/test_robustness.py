"""Bad input, fuzzing and faults: every request gets a right answer or a clear error, and the
server keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from app.engine import ImageRequest, InferenceEngine, TorchBackend, load_model
from app.logs import JsonFormatter, configure_logging
from preprocessing import PreprocessingError, TransformConfig, prepare
from tests import images
from tests.checks import assert_same_prediction
from tests.conftest import COLOR_MODEL, make_settings, serve
from tests.test_api import JPEG, assert_error

T = TypeVar("T")
FUZZ_EXAMPLES = int(os.environ.get("BATCHSERVE_FUZZ_EXAMPLES", "300"))


# -- bad input through the API -------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "data", "status", "code"),
    [
        (JPEG, b"PK\x03\x04" + b"\x00" * 200, 400, "invalid_image"),  # a zip file
        ({"content-type": "text/plain"}, images.jpeg(), 415, "unsupported_media_type"),
        (JPEG, images.jpeg(images.solid((10, 20, 30), 1, 1)), 400, "invalid_image"),  # 1x1
        (JPEG, images.jpeg(images.solid((10, 20, 30), 300, 4)), 400, "invalid_image"),
        ({"content-type": "image/png"}, images.corrupt_png(), 400, "invalid_image"),
    ],
    ids=["zip-as-jpeg", "jpeg-as-text", "one-pixel", "a-sliver", "png-bad-crc"],
)
async def test_more_bad_input(
    client: httpx.AsyncClient, headers: dict[str, str], data: bytes, status: int, code: str
) -> None:
    assert_error(await client.post("/predict", content=data, headers=headers), status, code)


async def test_multipart_edge_cases(client: httpx.AsyncClient) -> None:
    two = [("file", ("a.jpg", images.jpeg(), "image/jpeg")),
           ("file", ("b.jpg", images.jpeg(), "image/jpeg"))]  # fmt: skip
    assert_error(await client.post("/predict", files=two), 422, "invalid_parameter")
    text = {"file": ("notes.txt", b"just some text", "text/plain")}
    assert_error(await client.post("/predict", files=text), 400, "invalid_image")
    broken = await client.post(
        "/predict", content=b"--x\r\nnot multipart", headers={"content-type": "multipart/form-data"}
    )
    assert_error(broken, 422, "invalid_parameter")


async def test_a_very_long_header_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/predict", content=images.jpeg(), headers={**JPEG, "x-padding": "a" * 40_000}
    )
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "headers_too_large"
    assert (await client.post("/predict", content=images.jpeg(), headers=JPEG)).status_code == 200


async def test_good_requests_succeed_beside_bad_ones() -> None:
    async with serve(make_settings(max_batch_size=16, max_queue_delay_ms=30)) as (_, client):
        bodies = [images.jpeg(images.photo(120, 90, seed=s)) for s in range(8)]
        bad = [b"", b"garbage", images.png()[:150], images.jpeg_bomb()]
        mixed = [*bodies[:4], *bad, *bodies[4:]]
        responses = await asyncio.gather(
            *(client.post("/predict", content=data, headers=JPEG) for data in mixed)
        )
    statuses = [response.status_code for response in responses]
    assert statuses == [200] * 4 + [400, 400, 400, 413] + [200] * 4


# -- fuzzing -------------------------------------------------------------------------------

SEEDS = {
    "jpeg": images.jpeg(images.photo(64, 48, seed=1), quality=80),
    "png": images.png(images.photo(48, 40, seed=2)),
    "webp": images.webp(images.photo(40, 40, seed=3)),
    "gif": images.encode(images.photo(32, 32, seed=4), "GIF"),
}


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "header"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "header" and len(data) > 30:
            # Rewrite bytes in the header region, where sizes and markers live.
            spot = draw(st.integers(0, 29))
            data[spot] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=FUZZ_EXAMPLES * 3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(data=mutated())
def test_fuzzed_images_never_escape_as_unexpected_errors(data: bytes) -> None:
    config = TransformConfig(64, 72)
    try:
        prepared = prepare(data, config)
    except PreprocessingError:
        return
    assert prepared.pixels is not None
    assert tuple(prepared.pixels.shape) == (3, 64, 64)


class LoopThread:
    """An event loop in a thread, so synchronous hypothesis tests can drive the async app."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live_client() -> Iterator[tuple[LoopThread, httpx.AsyncClient]]:
    runner = LoopThread()
    context = serve(make_settings(max_batch_size=8, max_queue_delay_ms=1))
    _, client = runner.run(context.__aenter__())
    yield runner, client
    runner.run(context.__aexit__(None, None, None))
    runner.close()


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=mutated())
def test_fuzzed_uploads_never_get_a_500(
    live_client: tuple[LoopThread, httpx.AsyncClient], data: bytes
) -> None:
    runner, client = live_client
    response = runner.run(client.post("/predict", content=data, headers=JPEG))
    assert response.status_code in (200, 400, 413, 415), response.text
    if response.status_code != 200:
        assert response.json()["error"]["code"] in {
            "invalid_image", "too_large", "unsupported_media_type",
        }  # fmt: skip


def test_still_serving_after_the_fuzzing(live_client: tuple[LoopThread, httpx.AsyncClient]) -> None:
    runner, client = live_client
    response = runner.run(client.post("/predict", content=images.jpeg(), headers=JPEG))
    assert response.status_code == 200


# -- device out of memory ------------------------------------------------------------------


class RunsOutOfMemory(nn.Module):
    """Raises the out-of-memory error for batches larger than ``limit`` rows."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.sizes: list[int] = []
        self.base = load_model(COLOR_MODEL, "none").module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        logits: torch.Tensor = self.base(x)
        return logits


def oom_engine(limit: int) -> tuple[InferenceEngine, RunsOutOfMemory]:
    loaded = load_model(COLOR_MODEL, "none")
    model = RunsOutOfMemory(limit)
    backend = TorchBackend(model, torch.device("cpu"), torch.float32, (3, 224, 224))
    engine = InferenceEngine(loaded, backend, max_batch_size=8)
    model.sizes.clear()
    return engine, model


def test_out_of_memory_splits_the_batch_in_halves() -> None:
    engine, model = oom_engine(limit=2)
    requests = [
        ImageRequest(prepare(images.jpeg(images.photo(60, 60, seed=s)), engine.transform), 3)
        for s in range(5)
    ]
    results = engine.run_batch(requests)
    assert all(not isinstance(result, BaseException) for result in results)
    assert model.sizes == [5, 2, 3, 1, 2]  # 5 fails, 2 runs, 3 fails, then 1 and 2 run
    alone = [engine.run_batch([request])[0] for request in requests]
    for together, single in zip(results, alone, strict=True):
        assert_same_prediction(together, single)


def test_out_of_memory_for_a_single_image_fails_that_request_only() -> None:
    engine, _ = oom_engine(limit=0)
    request = ImageRequest(prepare(images.jpeg(), engine.transform), 3)
    results = engine.run_batch([request, request])
    assert all(isinstance(result, torch.OutOfMemoryError) for result in results)


# -- logs ----------------------------------------------------------------------------------


def test_json_log_lines_carry_the_request_id() -> None:
    record = logging.LogRecord("batchserve", logging.ERROR, __file__, 1, "boom %s", ("x",), None)
    record.request_id = "req-7"
    try:
        raise ValueError("inner")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "req-7"
    assert line["message"] == "boom x"
    assert line["level"] == "error"
    assert "ValueError: inner" in line["exception"]


def test_each_record_is_written_once_when_a_library_logs_through_the_root_logger(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    # As in a server: no handler on the root logger when the app configures logging.
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(logging.getLogger("batchserve"), "handlers", [])
    configure_logging("INFO", json_lines=False)
    configure_logging("INFO", json_lines=False)  # a second app in the same process
    logging.warning("a library's warning")  # what OpenVINO's telemetry does
    logging.getLogger("batchserve").info("served")
    err = capsys.readouterr().err
    assert err.count("a library's warning") == 1, err
    assert err.count("served") == 1, err
    assert " INFO batchserve [-] served" in err

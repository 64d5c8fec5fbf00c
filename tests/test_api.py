"""The HTTP API through the real app and its lifespan."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest

from app.cpus import available_cpus
from app.requestid import new_request_id
from tests import images
from tests.checks import metric
from tests.conftest import make_settings, serve
from tests.models import Exploding, Slow

JPEG = {"content-type": "image/jpeg"}
API_KEY = "let-me-in-0123456789"


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    assert "Traceback" not in response.text
    assert "/work/" not in response.text
    assert ".py" not in response.text


@pytest.fixture
def slow_model() -> Iterator[type[Slow]]:
    yield Slow
    Slow.seconds = 0.0


# -- happy paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("image/jpeg", images.jpeg()),
        ("image/png", images.png()),
        ("image/webp", images.webp()),
        ("application/octet-stream", images.jpeg()),
        ("image/jpeg", images.png()),  # the bytes decide, not the declared subtype
    ],
)
async def test_predict_raw_body(client: httpx.AsyncClient, content_type: str, data: bytes) -> None:
    response = await client.post("/predict", content=data, headers={"content-type": content_type})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["model"], body["version"]) == ("color_classifier", "1")
    assert len(body["predictions"]) == 5  # the TOP_K default
    first = body["predictions"][0]
    assert set(first) == {"index", "label", "score"}
    assert first["label"] == str(first["index"])


async def test_predict_multipart(client: httpx.AsyncClient) -> None:
    files = {"file": ("cat.jpg", images.jpeg(), "image/jpeg")}
    response = await client.post("/predict?top_k=2", files=files)
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == 2


def test_made_up_request_ids_are_unique_in_a_process_and_across_forks() -> None:
    made = [new_request_id() for _ in range(1000)]
    assert len(set(made)) == len(made)
    assert all(re.fullmatch(r"[0-9a-f]{32}", made_up) for made_up in made)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    in_child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert re.fullmatch(r"[0-9a-f]{32}", in_child)
    assert in_child[:16] != new_request_id()[:16]  # not the parent's ids continued


async def test_timing_and_request_id_headers(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict", content=images.jpeg(), headers=JPEG)
    timing = response.headers["server-timing"]
    stages = dict(part.strip().split(";dur=") for part in timing.split(","))
    for stage in ("parse", "decode", "queue", "forward", "postprocess", "total"):
        assert float(stages[stage]) >= 0
    assert float(stages["total"]) >= float(stages["forward"])
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    echoed = await client.post(
        "/predict", content=images.jpeg(), headers={**JPEG, "x-request-id": "client-42"}
    )
    assert echoed.headers["x-request-id"] == "client-42"
    unsafe = await client.get("/healthz", headers={"x-request-id": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"


async def test_health_readiness_and_models(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok", "state": "ready"}
    assert (await client.get("/readyz")).json() == {"status": "ready", "state": "ready"}
    (model,) = (await client.get("/v1/models")).json()["models"]
    assert model["architecture"] == "tests.models:color_classifier"
    assert model["name"] == model["architecture"]  # deprecated, kept one release
    assert model["weights"] == "random"
    assert model["device"] == "cpu"
    assert model["precision"] == "fp32"
    assert model["state"] == "ready"
    assert model["backend"] == {
        "name": "torch", "variant": "torchscript", "precision": "fp32", "fixed_shapes": False,
        "compile": "torchscript", "cuda_graphs": [],
    }  # fmt: skip
    assert model["batching"]["max_queue_bytes"] == 256 * 1024 * 1024
    assert model["input_shape"] == [3, 224, 224]
    assert model["num_classes"] == 12
    assert model["batching"]["max_batch_size"] == 8
    cpus = available_cpus()
    assert model["threads"] == {"forward": cpus, "torch_in_batches": cpus, "decode": 2}
    # On a CPU the first size is warm before ready, the others follow while idle.
    assert "1" in model["warmup_ms"]
    assert set(model["warmup_ms"]) <= {"1", "2", "4", "8"}


async def test_metrics_exposes_the_documented_names(client: httpx.AsyncClient) -> None:
    await client.post("/predict", content=images.jpeg(), headers=JPEG)
    await client.post("/predict", content=b"nope", headers=JPEG)
    response = await client.get("/metrics")
    assert response.status_code == 200
    text = response.text
    one = 'model="color_classifier",version="1"'
    for name in (
        f"batchserve_queue_depth{{{one}}}",
        "batchserve_batch_size_bucket",
        "batchserve_queue_wait_seconds_bucket",
        'batchserve_stage_seconds_bucket{le="0.001",model="color_classifier",stage="decode",'
        'version="1"}',
        'batchserve_stage_seconds_count{model="color_classifier",stage="forward",version="1"}',
        'batchserve_stage_seconds_count{model="color_classifier",stage="postprocess",version="1"}',
        f'batchserve_device_busy_seconds_total{{device="cpu",{one}}}',
        'batchserve_model_info{backend="torch",choice="",device="cpu",model="color_classifier",'
        'precision="fp32",task="classify",version="1",weights="random"}',
        f"batchserve_model_ready{{{one}}} 1.0",
        'batchserve_state{state="ready"} 1.0',
        "batchserve_admitted_bytes 0.0",
        "batchserve_device_preprocess_seconds_total",
        "http_requests_total",
        "process_resident_memory_bytes",
    ):
        assert name in text, name
    assert (
        metric(
            text, 'batchserve_requests_total{model="color_classifier",outcome="ok",route="predict"}'
        )
        == 1
    )
    assert metric(text, 'batchserve_requests_total{outcome="invalid",route="predict"}') == 1
    assert metric(text, "batchserve_device_busy_seconds_total") > 0
    # Each answer is timed once, by outcome, by batchserve's own histogram...
    ok = 'model="color_classifier",outcome="ok",route="predict"'
    assert metric(text, f"batchserve_request_duration_seconds_count{{{ok}}}") == 1
    assert metric(text, f"batchserve_request_duration_seconds_sum{{{ok}}}") > 0
    invalid = 'outcome="invalid",route="predict"'
    assert metric(text, f"batchserve_request_duration_seconds_count{{{invalid}}}") == 1
    # ... and not again by the instrumentator, which keeps the other routes.
    assert 'handler="/predict"' not in text


# -- batching through HTTP -----------------------------------------------------------------


async def test_concurrent_requests_share_batches() -> None:
    async with serve(make_settings(max_batch_size=16, max_queue_delay_ms=20)) as (_, client):
        data = images.jpeg()
        responses = await asyncio.gather(
            *(client.post("/predict", content=data, headers=JPEG) for _ in range(32))
        )
        assert all(response.status_code == 200 for response in responses)
        text = (await client.get("/metrics")).text
    batches = metric(text, "batchserve_batch_size_count")
    requests = metric(text, "batchserve_batch_size_sum")
    assert requests == 32
    assert requests / batches > 1
    assert max(int(r.headers["x-batch-size"]) for r in responses) > 1


async def test_no_mix_ups_between_requests_that_share_a_batch() -> None:
    """Distinct images sent together get exactly what each gets alone."""
    pictures = [images.jpeg(images.photo(200, 150, seed=seed)) for seed in range(24)]
    async with serve(make_settings(max_batch_size=8, max_queue_delay_ms=20)) as (_, client):
        alone = []
        for data in pictures:
            response = await client.post("/predict?top_k=12", content=data, headers=JPEG)
            assert response.headers["x-batch-size"] == "1"
            alone.append(response.json()["predictions"])
        together = await asyncio.gather(
            *(client.post("/predict?top_k=12", content=data, headers=JPEG) for data in pictures)
        )
    assert max(int(response.headers["x-batch-size"]) for response in together) > 1
    # The model's answers really differ between images, so a swap could not go unnoticed.
    assert len({tuple(p["index"] for p in prediction) for prediction in alone}) > 12
    for single, response in zip(alone, together, strict=True):
        batched = response.json()["predictions"]
        assert [p["index"] for p in batched] == [p["index"] for p in single]
        for a, b in zip(batched, single, strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)


# -- client errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "data", "status", "code"),
    [
        (JPEG, b"", 400, "invalid_image"),
        (JPEG, b"this is plain text, not a JPEG", 400, "invalid_image"),
        (JPEG, images.jpeg()[:1500], 400, "invalid_image"),
        ({"content-type": "image/png"}, images.png()[:200], 400, "invalid_image"),
        ({"content-type": "image/tiff"}, images.encode(images.photo(), "TIFF"), 415,
         "unsupported_media_type"),
        ({"content-type": "application/json"}, b'{"image": "x"}', 415, "unsupported_media_type"),
        ({}, images.jpeg(), 415, "unsupported_media_type"),
        (JPEG, images.jpeg_bomb(), 413, "too_large"),
        ({"content-type": "image/png"}, images.png_bomb(), 413, "too_large"),
    ],
    ids=["empty", "text", "truncated-jpeg", "truncated-png", "tiff", "json", "no-type",
         "jpeg-bomb", "png-bomb"],
)  # fmt: skip
async def test_bad_input_is_answered_with_the_right_error(
    client: httpx.AsyncClient, headers: dict[str, str], data: bytes, status: int, code: str
) -> None:
    response = await client.post("/predict", content=data, headers=headers)
    assert_error(response, status, code)
    assert (await client.post("/predict", content=images.jpeg(), headers=JPEG)).status_code == 200


@pytest.mark.parametrize("top_k", ["0", "-1", "13", "abc", "1.5"])
async def test_bad_top_k(client: httpx.AsyncClient, top_k: str) -> None:
    response = await client.post(f"/predict?top_k={top_k}", content=images.jpeg(), headers=JPEG)
    assert_error(response, 422, "invalid_parameter")
    assert "top_k" in response.json()["error"]["message"]


async def test_top_k_may_be_every_class(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict?top_k=12", content=images.jpeg(), headers=JPEG)
    assert len(response.json()["predictions"]) == 12


async def test_multipart_without_a_file_field(client: httpx.AsyncClient) -> None:
    response = await client.post("/predict", files={"image": ("a.jpg", images.jpeg())})
    assert_error(response, 422, "invalid_parameter")
    assert "'file'" in response.json()["error"]["message"]


async def test_body_over_the_byte_limit() -> None:
    async with serve(make_settings(max_image_bytes=4096)) as (_, client):
        big = images.jpeg(images.photo(400, 300), quality=95)
        assert len(big) > 4096
        assert_error(await client.post("/predict", content=big, headers=JPEG), 413, "too_large")

        async def chunked() -> object:
            for start in range(0, len(big), 1000):
                yield big[start : start + 1000]

        response = await client.post("/predict", content=chunked(), headers=JPEG)  # type: ignore[arg-type]
        assert_error(response, 413, "too_large")
        files = {"file": ("big.jpg", big, "image/jpeg")}
        assert_error(await client.post("/predict", files=files), 413, "too_large")


async def test_bad_timeout_header(client: httpx.AsyncClient) -> None:
    for value in ("soon", "-5", "0", "nan"):
        response = await client.post(
            "/predict", content=images.jpeg(), headers={**JPEG, "x-request-timeout-ms": value}
        )
        assert_error(response, 422, "invalid_parameter")


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/nope"), 404, "not_found")
    assert_error(await client.get("/predict"), 405, "method_not_allowed")


# -- server-side failures and limits -------------------------------------------------------


async def test_model_failure_is_a_500_for_that_batch_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A traced model would lose the Python-level switch that injects the failure; every batch
    # size is warm before ready, so that no warm-up after ready takes the injected failure.
    settings = make_settings(model="tests.models:exploding", compile="none", warmup="all")
    async with serve(settings) as (_, client):
        Exploding.fail_next = 1
        with caplog.at_level(logging.ERROR, logger="batchserve"):
            response = await client.post(
                "/predict", content=images.jpeg(), headers={**JPEG, "x-request-id": "req-500"}
            )
        assert_error(response, 500, "internal_error")
        assert "injected failure" not in response.text
        assert "req-500" in caplog.text  # logged with the request id, traceback and all
        assert "injected failure" in caplog.text
        ok = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert ok.status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, 'batchserve_requests_total{outcome="error",route="predict"}') == 1


async def test_full_queue_answers_503_with_retry_after(slow_model: type[Slow]) -> None:
    settings = make_settings(
        model="tests.models:slow",
        max_batch_size=1,
        max_inflight_batches=1,
        max_queue_size=1,
        compile="none",
    )
    async with serve(settings) as (_, client):
        slow_model.seconds = 0.3
        responses = await asyncio.gather(
            *(client.post("/predict", content=images.jpeg(), headers=JPEG) for _ in range(4))
        )
        statuses = sorted(response.status_code for response in responses)
        assert statuses[0] == 200
        assert statuses[-1] == 503
        for response in responses:
            if response.status_code == 503:
                assert_error(response, 503, "overloaded")
                assert int(response.headers["retry-after"]) >= 1
        text = (await client.get("/metrics")).text
        assert metric(text, 'batchserve_requests_total{outcome="overloaded",route="predict"}') >= 1


async def test_a_full_server_makes_room_for_a_higher_priority(slow_model: type[Slow]) -> None:
    settings = make_settings(model="tests.models:slow", max_batch_size=1, max_inflight_batches=1,
                             max_queue_size=2, compile="none")  # fmt: skip
    async with serve(settings) as (_, client):
        slow_model.seconds = 0.3

        def post(priority: int) -> asyncio.Future[httpx.Response]:
            headers = {**JPEG, "x-priority": str(priority)}
            return asyncio.ensure_future(
                client.post("/predict", content=images.jpeg(), headers=headers)
            )

        async def scrape(name: str) -> float:
            return metric((await client.get("/metrics")).text, name)

        running = post(2)
        await until_async(lambda: scrape("batchserve_inflight_batches"), 1)
        older = post(3)
        await until_async(lambda: scrape("batchserve_queue_depth"), 1)
        newer = post(3)
        await until_async(lambda: scrape("batchserve_queue_depth"), 2)
        urgent = post(1)  # admission is full: the newest priority-3 request makes room
        displaced = await newer
        assert_error(displaced, 503, "overloaded")
        assert int(displaced.headers["retry-after"]) >= 1
        assert (await urgent).status_code == 200
        assert not older.done()  # the urgent one went first
        assert (await older).status_code == 200
        assert (await running).status_code == 200
        slow_model.seconds = 0.0
        assert await scrape('batchserve_dropped_requests_total{reason="displaced"}') == 1


async def until_async(
    read: Callable[[], Awaitable[float]], expected: float, limit_s: float = 10.0
) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while await read() != expected:
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


async def test_request_deadline_is_a_504(slow_model: type[Slow]) -> None:
    async with serve(make_settings(model="tests.models:slow", compile="none")) as (_, client):
        slow_model.seconds = 0.5
        response = await client.post(
            "/predict", content=images.jpeg(), headers={**JPEG, "x-request-timeout-ms": "100"}
        )
        assert_error(response, 504, "deadline_exceeded")
        slow_model.seconds = 0.0
        text = (await client.get("/metrics")).text
        assert (
            metric(text, 'batchserve_requests_total{outcome="deadline_exceeded",route="predict"}')
            == 1
        )


async def test_a_client_cannot_ask_for_a_longer_deadline_than_the_cap(
    slow_model: type[Slow],
) -> None:
    settings = make_settings(model="tests.models:slow", compile="none", request_timeout_ms=100,
                             max_request_timeout_ms=150)  # fmt: skip
    async with serve(settings) as (_, client):
        slow_model.seconds = 0.5
        asked = {**JPEG, "x-request-timeout-ms": "60000"}  # a minute: cut to 150 ms
        response = await client.post("/predict", content=images.jpeg(), headers=asked)
        assert_error(response, 504, "deadline_exceeded")
        slow_model.seconds = 0.0
        await asyncio.sleep(0.5)  # the cut request's forward pass is still running
        shorter = {**JPEG, "x-request-timeout-ms": "5000"}
        assert (await client.post("/predict", content=images.jpeg(), headers=shorter)).is_success


async def test_api_key() -> None:
    async with serve(make_settings(api_key=API_KEY, protect_metrics=True)) as (_, client):
        denied = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert_error(denied, 401, "unauthorized")
        assert denied.headers["www-authenticate"] == "Bearer"
        wrong = await client.post(
            "/predict", content=images.jpeg(), headers={**JPEG, "authorization": "Bearer nope"}
        )
        assert wrong.json() == denied.json()
        good = await client.post(
            "/predict",
            content=images.jpeg(),
            headers={**JPEG, "authorization": f"Bearer {API_KEY}"},
        )
        assert good.status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/metrics")).status_code == 401
        auth = {"authorization": f"Bearer {API_KEY}"}
        assert (await client.get("/metrics", headers=auth)).status_code == 200


async def test_a_crashed_batching_loop_turns_readiness_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve(make_settings()) as (_, client):

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in the dispatch rule")

        monkeypatch.setattr("batching.batcher.decide", broken)
        response = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert_error(response, 503, "not_ready")
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {
            "status": "not_ready", "state": "failed",
            "reason": "the batching loop of color_classifier/1 failed",
        }  # fmt: skip
        again = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert_error(again, 503, "not_ready")
        # A dead batcher never comes back: liveness fails so that the process is restarted.
        alive = await client.get("/healthz")
        assert alive.status_code == 503
        assert alive.json()["state"] == "failed"
        text = (await client.get("/metrics")).text
        assert metric(text, "batchserve_ready") == 0
        assert metric(text, 'batchserve_state{state="failed"}') == 1


@pytest.mark.parametrize(
    "query", ["top_k=0", "top_k=abc", "top_k=1.5", "top_k=-2", "top_k=", "version=0", "version=x"]
)
async def test_predict_refuses_parameters_out_of_their_documented_range(
    client: httpx.AsyncClient, query: str
) -> None:
    response = await client.post(f"/predict?{query}", content=images.jpeg(), headers=JPEG)
    assert_error(response, 422, "invalid_parameter")
    assert query.partition("=")[0] in response.json()["error"]["message"]


async def test_predict_takes_the_parameters_its_documentation_names(
    client: httpx.AsyncClient,
) -> None:
    documented = (await client.get("/openapi.json")).json()["paths"]["/predict"]["post"]
    parameters = {p["name"]: p["schema"] for p in documented["parameters"]}
    assert set(parameters) == {"top_k", "model", "version", "min_score", "max_detections",
                               "masks"}  # fmt: skip
    assert parameters["masks"] == {"type": "boolean", "default": True, "title": "Masks",
                                   "description": parameters["masks"]["description"]}  # fmt: skip
    assert parameters["top_k"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert parameters["min_score"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 1}
    assert parameters["version"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    answer = await client.post(
        "/predict?top_k=2&model=color_classifier&version=1", content=images.jpeg(), headers=JPEG
    )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["predictions"]) == 2
    missing = await client.post("/predict?version=2", content=images.jpeg(), headers=JPEG)
    assert_error(missing, 404, "not_found")


async def test_the_key_is_checked_before_any_parameter() -> None:
    async with serve(make_settings(api_key=API_KEY)) as (_, client):
        for query in ("top_k=abc", "top_k=0", "top_k=999"):
            denied = await client.post(f"/predict?{query}", content=images.jpeg(), headers=JPEG)
            assert_error(denied, 401, "unauthorized")
        bad_timeout = await client.post(
            "/predict", content=b"", headers={**JPEG, "x-request-timeout-ms": "soon"}
        )
        assert_error(bad_timeout, 401, "unauthorized")
        authorized = {**JPEG, "authorization": f"Bearer {API_KEY}"}
        wrong = await client.post("/predict?top_k=abc", content=images.jpeg(), headers=authorized)
        assert_error(wrong, 422, "invalid_parameter")


async def test_every_answer_of_predict_is_counted_once() -> None:
    settings = make_settings(api_key=API_KEY, max_header_bytes=2048)
    auth = {**JPEG, "authorization": f"Bearer {API_KEY}"}
    async with serve(settings) as (_, client):
        answers = [
            await client.post("/predict", content=images.jpeg(), headers=auth),  # 200
            await client.post("/predict", content=images.jpeg(), headers=JPEG),  # 401
            await client.post("/predict?top_k=0", content=images.jpeg(), headers=auth),  # 422
            await client.post("/predict?top_k=13", content=images.jpeg(), headers=auth),  # 422
            await client.post("/predict", content=b"junk", headers=auth),  # 400
            await client.post("/predict", content=images.jpeg(), headers={**auth, "x-big": "x" * 4000}),  # noqa: E501
        ]  # fmt: skip
        assert [r.status_code for r in answers] == [200, 401, 422, 422, 400, 431]
        await client.get("/healthz")  # not a prediction: not counted
        text = (await client.get("/metrics", headers=auth)).text
    counts = {
        outcome: metric(text, f'batchserve_requests_total{{outcome="{outcome}",route="predict"}}')
        for outcome in ("ok", "unauthorized", "invalid", "error", "cancelled", "not_ready")
    }
    assert counts == {
        "ok": 1, "unauthorized": 1, "invalid": 4, "error": 0, "cancelled": 0, "not_ready": 0,
    }  # fmt: skip


async def test_stages_mean_one_thing_each() -> None:
    async with serve(make_settings()) as (_, client):
        response = await client.post("/predict", content=images.jpeg(), headers=JPEG)
        assert response.status_code == 200
        text = (await client.get("/metrics")).text
    # Decoded on the CPU: one per-request "decode", no per-batch "device_decode".
    assert metric(text, 'batchserve_stage_seconds_count{stage="decode"}') == 1
    assert metric(text, 'batchserve_stage_seconds_count{stage="device_decode"}') == 0
    assert metric(text, 'batchserve_stage_seconds_count{stage="forward"}') == 1
    # Queue waits have one home: the batcher's histogram, not a "queue" stage.
    assert 'stage="queue"' not in text
    assert metric(text, "batchserve_queue_wait_seconds_count") == 1
    # The device's work is counted: the forward pass and the preparation of its input.
    assert metric(text, "batchserve_device_busy_seconds_total") > 0
    assert metric(text, "batchserve_device_preprocess_seconds_total") > 0

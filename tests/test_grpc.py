"""The Open Inference Protocol over gRPC, checked with Triton's own gRPC clients (sync and
asyncio), the standard health-check client and server reflection, against real uvicorn
processes: the same answers as over REST, errors as gRPC statuses, limits, cancellation, the
drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from harness.servers import UvicornProcess
from tests import images
from tests.checks import assert_graceful_exit, scrape, wait_for
from tests.repository import add_model, colour_repository

grpcclient = pytest.importorskip("tritonclient.grpc")
grpcaio = pytest.importorskip("tritonclient.grpc.aio")
utils = pytest.importorskip("tritonclient.utils")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")

pytestmark = pytest.mark.e2e

MODEL = "color_classifier"
MiB = 1024 * 1024
KEY = "open-sesame-0123456789"
BASE_ENV = {
    "BATCHSERVE_MODEL": "tests.models:color_classifier",
    "BATCHSERVE_WEIGHTS": "none",
    "BATCHSERVE_PRECISION": "fp32",
    "BATCHSERVE_MAX_BATCH_SIZE": "8",
    "BATCHSERVE_LOG_LEVEL": "warning",
}
SLOW_ENV = {
    **BASE_ENV,
    "BATCHSERVE_MODEL": "tests.models:slow_from_env",
    "BATCHSERVE_MODEL_NAME": MODEL,
    "BATCHSERVE_MAX_BATCH_SIZE": "1",
    "BATCHSERVE_MAX_INFLIGHT_BATCHES": "1",
    "BATCHSERVE_COMPILE": "none",  # tracing would drop the model's sleep
}
PICTURES = [images.jpeg(images.photo(220, 160, seed=seed)) for seed in range(3)]


@pytest.fixture(scope="module")
def server() -> Iterator[UvicornProcess]:
    env = {
        **BASE_ENV,
        "BATCHSERVE_MAX_IMAGE_BYTES": str(10 * MiB),
        "BATCHSERVE_MAX_QUEUE_BYTES": str(32 * MiB),
    }
    with UvicornProcess(env) as process:
        yield process


@pytest.fixture
def client(server: UvicornProcess) -> Iterator[Any]:
    triton = grpcclient.InferenceServerClient(server.grpc_target)
    yield triton
    triton.close()


def image_input(pictures: list[bytes]) -> Any:
    tensor = grpcclient.InferInput("image", [len(pictures)], "BYTES")
    tensor.set_data_from_numpy(np.array(pictures, dtype=np.object_))
    return tensor


def rest_probabilities(server: UvicornProcess, data: bytes) -> np.ndarray:
    """What ``/predict`` answers for the same image, as dense probabilities."""
    response = httpx.post(f"{server.url}/predict?top_k=12", content=data,
                          headers={"content-type": "image/jpeg"})  # fmt: skip
    assert response.status_code == 200, response.text
    dense = np.zeros(12, dtype=np.float32)
    for entry in response.json()["predictions"]:
        dense[entry["index"]] = entry["score"]
    return dense


def status_of(call: Any) -> Any:
    with pytest.raises(utils.InferenceServerException) as raised:
        call()
    return raised.value.status()


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("no_such_model")
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "batchserve"
    assert {"classification", "model_repository"} <= set(server["extensions"])
    model = client.get_model_metadata(MODEL, as_json=True)
    assert model["name"] == MODEL
    assert model["versions"] == ["1"]
    assert [(each["name"], each["datatype"]) for each in model["inputs"]] == [
        ("image", "BYTES"), ("pixels", "UINT8"), ("tensor", "FP32"),
    ]  # fmt: skip
    assert model["outputs"][0] == {"name": "probabilities", "datatype": "FP32",
                                   "shape": ["-1", "12"]}  # fmt: skip


def test_images_as_rest_answers_them(server: UvicornProcess, client: Any) -> None:
    result = client.infer(MODEL, [image_input(PICTURES)])
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (3, 12)
    assert result.get_response().model_version == "1"
    for row, data in zip(probabilities, PICTURES, strict=True):
        np.testing.assert_allclose(row, rest_probabilities(server, data), atol=1e-5)
    one = client.infer(MODEL, [image_input(PICTURES[:1])]).as_numpy("probabilities")
    np.testing.assert_allclose(one[0], probabilities[0], atol=1e-5)


def test_classification_extension(client: Any) -> None:
    outputs = [grpcclient.InferRequestedOutput("probabilities", class_count=3)]
    result = client.infer(MODEL, [image_input(PICTURES)], outputs=outputs)
    labels = result.as_numpy("probabilities")
    assert labels.shape == (3, 3)
    dense = client.infer(MODEL, [image_input(PICTURES)]).as_numpy("probabilities")
    for row, ranked in zip(dense, labels, strict=True):
        scores = [float(entry.decode().split(":")[0]) for entry in ranked]
        indices = [int(entry.decode().split(":")[1]) for entry in ranked]
        assert indices == list(np.argsort(-row)[:3])
        np.testing.assert_allclose(scores, row[indices], atol=1e-5)


def test_pixels_and_tensors_as_rest_answers_them(server: UvicornProcess, client: Any) -> None:
    http = pytest.importorskip("tritonclient.http")
    rest = http.InferenceServerClient(server.url.removeprefix("http://"))
    rng = np.random.default_rng(0)
    pixels = np.asarray(images.photo(120, 90, seed=4), dtype=np.uint8)[None]
    tensor = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
    for name, datatype, array in (("pixels", "UINT8", pixels), ("tensor", "FP32", tensor)):
        over_grpc = grpcclient.InferInput(name, list(array.shape), datatype)
        over_grpc.set_data_from_numpy(array)
        over_rest = http.InferInput(name, list(array.shape), datatype)
        over_rest.set_data_from_numpy(array, binary_data=True)
        got = client.infer(MODEL, [over_grpc]).as_numpy("probabilities")
        expected = rest.infer(MODEL, [over_rest]).as_numpy("probabilities")
        assert got.shape == (len(array), 12)
        np.testing.assert_allclose(got, expected, atol=1e-5)
    rest.close()


def test_typed_contents_are_read_as_raw_ones(server: UvicornProcess, client: Any) -> None:
    """Not what Triton's client sends, but what the protocol allows: ``contents``."""
    pixels = np.asarray(images.photo(32, 24, seed=5), dtype=np.uint8)[None]
    typed = service_pb2.ModelInferRequest(model_name=MODEL)
    contents = service_pb2.InferTensorContents
    typed.inputs.add(name="pixels", datatype="UINT8", shape=list(pixels.shape),
                     contents=contents(uint_contents=pixels.ravel().tolist()))  # fmt: skip
    typed.inputs.add(name="image", datatype="BYTES", shape=[1],
                     contents=contents(bytes_contents=PICTURES[:1]))  # fmt: skip
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as two_inputs:
            stub.ModelInfer(typed)
        assert two_inputs.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        del typed.inputs[1]
        reply = stub.ModelInfer(typed)
    got = np.frombuffer(reply.raw_output_contents[0], dtype="<f4")
    raw = grpcclient.InferInput("pixels", list(pixels.shape), "UINT8")
    raw.set_data_from_numpy(pixels)
    expected = client.infer(MODEL, [raw]).as_numpy("probabilities")[0]
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_priority_and_timeout(client: Any) -> None:
    first = client.infer(MODEL, [image_input(PICTURES[:1])], priority=1, timeout=5_000_000)
    assert first.as_numpy("probabilities").shape == (1, 12)
    late = status_of(lambda: client.infer(MODEL, [image_input(PICTURES[:1])], timeout=1))
    assert late == "StatusCode.DEADLINE_EXCEEDED"
    wrong = status_of(lambda: client.infer(MODEL, [image_input(PICTURES[:1])], priority=99))
    assert wrong == "StatusCode.INVALID_ARGUMENT"


def test_errors_are_grpc_statuses(client: Any) -> None:
    broken = image_input([b"not an image"])
    assert status_of(lambda: client.infer(MODEL, [broken])) == "StatusCode.INVALID_ARGUMENT"
    assert status_of(lambda: client.infer("no_such_model", [image_input(PICTURES[:1])])) == (
        "StatusCode.NOT_FOUND"
    )
    assert status_of(
        lambda: client.infer(MODEL, [image_input(PICTURES[:1])], model_version="7")
    ) == "StatusCode.NOT_FOUND"  # fmt: skip
    unknown = grpcclient.InferInput("audio", [1], "BYTES")
    unknown.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
    assert status_of(lambda: client.infer(MODEL, [unknown])) == "StatusCode.INVALID_ARGUMENT"
    too_many = [grpcclient.InferRequestedOutput("probabilities", class_count=13)]
    assert status_of(
        lambda: client.infer(MODEL, [image_input(PICTURES[:1])], outputs=too_many)
    ) == "StatusCode.INVALID_ARGUMENT"  # fmt: skip
    assert status_of(lambda: client.get_model_config(MODEL)) == "StatusCode.UNIMPLEMENTED"
    # Without model control, loading is refused as over REST (400 there).
    assert status_of(lambda: client.load_model(MODEL)) == "StatusCode.INVALID_ARGUMENT"


def test_a_malformed_tensor_is_invalid_argument(server: UvicornProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="pixels", datatype="UINT8", shape=[1, 4, 4, 3])
    request.raw_input_contents.append(b"\x00" * 47)  # one byte short of 4 * 4 * 3
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in (raised.value.details() or "")


def noise_png(width: int, height: int) -> bytes:
    """A PNG that does not compress: larger than gRPC's default 4 MiB message."""
    rng = np.random.default_rng(width)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=0)
    return buffer.getvalue()


def test_images_over_four_mebibytes(server: UvicornProcess, client: Any) -> None:
    large = noise_png(1400, 1100)
    assert 4 * MiB < len(large) < 5 * MiB
    result = client.infer(MODEL, [image_input([large, large])])  # 9 MiB in one message
    assert result.as_numpy("probabilities").shape == (2, 12)
    # A message over what one request may carry (MAX_IMAGE_BYTES, 10 MiB), as over HTTP.
    over = status_of(lambda: client.infer(MODEL, [image_input([large, large, large])]))
    assert over == "StatusCode.RESOURCE_EXHAUSTED"


def test_standard_health_check_and_reflection(server: UvicornProcess) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= set(services)


def test_calls_are_counted_in_the_metrics(server: UvicornProcess, client: Any) -> None:
    ok = 'batchserve_requests_total{route="grpc_infer",outcome="ok"}'
    before = scrape(server, ok)
    client.infer(MODEL, [image_input(PICTURES[:1])])
    assert scrape(server, ok) == before + 1
    status_of(lambda: client.infer(MODEL, [image_input([b"broken"])]))
    assert scrape(server, 'batchserve_requests_total{route="grpc_infer",outcome="ok"}') == (
        before + 1
    )
    timed = 'batchserve_request_duration_seconds_count{route="grpc_infer",outcome="ok"}'
    assert scrape(server, timed) == before + 1


def test_the_asyncio_client(server: UvicornProcess) -> None:
    async def scenario() -> list[np.ndarray]:
        client = grpcaio.InferenceServerClient(server.grpc_target)
        try:
            assert await client.is_server_ready()
            replies = await asyncio.gather(
                *(client.infer(MODEL, [image_input([data])]) for data in PICTURES * 4)
            )
        finally:
            await client.close()
        return [reply.as_numpy("probabilities")[0] for reply in replies]

    answers = asyncio.run(scenario())
    for index, data in enumerate(PICTURES):
        np.testing.assert_allclose(answers[index], rest_probabilities(server, data), atol=1e-5)


# -- a slow model: cancellation, the call's deadline, the drain ----------------------------------


@pytest.mark.slow
def test_a_cancelled_call_and_an_expired_deadline_withdraw_their_images() -> None:
    env = {**SLOW_ENV, "BATCHSERVE_TEST_SLOW_SECONDS": "0.5"}
    with UvicornProcess(env) as server:

        async def scenario() -> None:
            client = grpcaio.InferenceServerClient(server.grpc_target)
            try:
                running = asyncio.ensure_future(client.infer(MODEL, [image_input(PICTURES[:1])]))
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_inflight_batches") == 1
                )
                quitter = asyncio.ensure_future(client.infer(MODEL, [image_input(PICTURES[:2])]))
                expiring = client.infer(MODEL, [image_input(PICTURES[:1])], client_timeout=0.2)
                late = asyncio.ensure_future(expiring)
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 3
                )
                quitter.cancel()
                with pytest.raises(utils.InferenceServerException) as raised:
                    await late
                assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 0
                )
                reply = await running
                assert reply.as_numpy("probabilities").shape == (1, 12)
            finally:
                await client.close()

        asyncio.run(scenario())
        time.sleep(0.6)  # had they been dispatched, their batches would have finished by now
        assert scrape(server, 'batchserve_batches_total{result="ok"}') == 1


@pytest.mark.slow
def test_sigterm_drains_grpc_calls() -> None:
    env = {**SLOW_ENV, "BATCHSERVE_TEST_SLOW_SECONDS": "0.3", "BATCHSERVE_DRAIN_TIMEOUT_S": "20"}
    with UvicornProcess(env) as server:

        async def scenario() -> tuple[list[Any], Any, Any, bool]:
            client = grpcaio.InferenceServerClient(server.grpc_target)
            try:
                accepted = [
                    asyncio.ensure_future(client.infer(MODEL, [image_input(PICTURES[:1])]))
                    for _ in range(4)
                ]
                await asyncio.to_thread(
                    wait_for, lambda: scrape(server, "batchserve_queue_depth") == 3
                )
                server.terminate()
                await asyncio.sleep(0.1)
                async with grpc.aio.insecure_channel(server.grpc_target) as channel:
                    health = health_pb2_grpc.HealthStub(channel)
                    serving = await health.Check(health_pb2.HealthCheckRequest())
                ready = await client.is_server_ready()
                try:
                    await client.infer(MODEL, [image_input(PICTURES[:1])])
                    refused: Any = None
                except utils.InferenceServerException as exc:
                    refused = exc.status()
                replies = await asyncio.gather(*accepted, return_exceptions=True)
            finally:
                await client.close()
            return replies, serving.status, refused, ready

        replies, serving, refused, ready = asyncio.run(scenario())
        assert all(not isinstance(reply, BaseException) for reply in replies), replies
        assert serving == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not ready
        assert refused == "StatusCode.UNAVAILABLE"
        assert_graceful_exit(server, server.wait(timeout=20))
        assert "Traceback" not in server.read_output()


# -- start-up, keys and the repository ------------------------------------------------------------


def test_a_taken_port_stops_start_up_with_one_clear_line() -> None:
    with socket.socket() as taken:
        # A holder that allows sharing: only gRPC's own SO_REUSEPORT (off) keeps it from joining.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = UvicornProcess({**BASE_ENV, "BATCHSERVE_GRPC_PORT": str(port)})
        try:
            with pytest.raises(RuntimeError, match="exited early") as failed:
                process.__enter__()
        finally:
            process.stop()
    lines = [line for line in str(failed.value).splitlines() if "CRITICAL" in line]
    assert len(lines) == 1
    assert (
        f"cannot start: cannot listen for gRPC on 127.0.0.1:{port}: the port is taken" in (lines[0])
    )


def test_keys_and_the_repository_over_grpc(tmp_path: Path) -> None:
    env = {
        **BASE_ENV,
        "BATCHSERVE_MODEL_REPOSITORY": str(colour_repository(tmp_path)),
        "BATCHSERVE_MODEL_CONTROL": "explicit",
        "BATCHSERVE_LOAD_MODELS": "colors",
        "BATCHSERVE_API_KEY": KEY,
    }
    with UvicornProcess(env) as server:
        client = grpcclient.InferenceServerClient(server.grpc_target)
        key = {"authorization": f"Bearer {KEY}"}
        try:
            # Health stays open, as over HTTP; everything else needs the key, as over HTTP.
            assert client.is_server_live()
            assert client.is_server_ready()
            assert client.is_model_ready("colors")
            for headers in (None, {"authorization": "Bearer wrong"}):
                for call in (
                    lambda h=headers: client.get_model_repository_index(headers=h),
                    lambda h=headers: client.get_server_metadata(headers=h),
                    lambda h=headers: client.get_model_metadata("colors", headers=h),
                    lambda h=headers: client.infer("colors", [image_input(PICTURES[:1])],
                                                   headers=h),
                ):  # fmt: skip
                    assert status_of(call) == "StatusCode.UNAUTHENTICATED"
            assert reflection_status(server.grpc_target, {}) == grpc.StatusCode.UNAUTHENTICATED
            assert reflection_status(server.grpc_target, key) == grpc.StatusCode.OK
            with httpx.Client(base_url=server.url) as http:
                assert http.get("/v2").status_code == 401
                assert http.get("/v2/models/colors").status_code == 401
                assert http.get("/v2/models/colors/ready").status_code == 200
                assert http.get("/v2", headers=key).status_code == 200
            unauthorized = 'batchserve_requests_total{route="grpc_infer",outcome="unauthorized"}'
            assert scrape(server, unauthorized) == 2
            assert client.get_server_metadata(headers=key).name == "batchserve"
            index = client.get_model_repository_index(headers=key, as_json=True)["models"]
            assert {(m["name"], m.get("state")) for m in index} >= {
                ("colors", "READY"), ("probe", "UNAVAILABLE"),
            }  # fmt: skip
            assert not client.is_model_ready("probe")
            client.load_model("probe", headers=key)
            assert client.is_model_ready("probe")
            image = image_input(PICTURES[:1])
            latest = client.infer("colors", [image], headers=key)
            assert latest.get_response().model_version == "2"
            np.testing.assert_allclose(
                latest.as_numpy("probabilities"), rest_v2(server, "colors", "2"), atol=1e-5
            )
            client.unload_model("probe", headers=key)
            assert not client.is_model_ready("probe")
            gone = status_of(lambda: client.infer("probe", [image], headers=key))
            assert gone == "StatusCode.NOT_FOUND"
        finally:
            client.close()


def reflection_status(target: str, metadata: dict[str, str]) -> Any:
    """The status of one reflection call (list the services) with ``metadata``."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            for _ in stub.ServerReflectionInfo(iter([request]), metadata=list(metadata.items())):
                pass
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def rest_v2(server: UvicornProcess, model: str, version: str) -> np.ndarray:
    http = pytest.importorskip("tritonclient.http")
    rest = http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = http.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array(PICTURES[:1], dtype=np.object_))
    try:
        key = {"authorization": f"Bearer {KEY}"}
        result = rest.infer(model, [tensor], model_version=version, headers=key)
        return result.as_numpy("probabilities")  # type: ignore[no-any-return]
    finally:
        rest.close()


def test_grpc_listens_where_uvicorn_was_told_to_unless_told_otherwise() -> None:
    from app.grpc.receiving import receive_slots
    from app.grpc.server import http_host, listen_address, max_calls
    from app.grpc.service import message_limit
    from tests.conftest import make_settings

    assert http_host(["uvicorn", "app.main:app", "--host", "0.0.0.0"], {}) == "0.0.0.0"
    assert http_host(["uvicorn", "app.main:app", "--host=::"], {}) == "::"
    assert http_host(["uvicorn", "app.main:app"], {"UVICORN_HOST": "10.0.0.5"}) == "10.0.0.5"
    assert http_host(["python", "serve.py"], {}) == "127.0.0.1"
    assert listen_address(make_settings(grpc_port=8001, grpc_host="::1")) == "[::1]:8001"
    assert listen_address(make_settings(grpc_port=9000, grpc_host="0.0.0.0")) == "0.0.0.0:9000"
    # A message carries what one HTTP request may: MAX_IMAGE_BYTES, and its own fields.
    settings = make_settings(max_image_bytes=MiB, max_queue_bytes=64 * MiB, max_queue_size=100)
    assert message_limit(settings) == MiB + 64 * 1024
    assert message_limit(make_settings()) == 20 * MiB + 64 * 1024
    # Messages received at once hold a quarter of MAX_QUEUE_BYTES, and at least one fits.
    assert receive_slots(settings, message_limit(settings)) == 15
    assert receive_slots(make_settings(), message_limit(make_settings())) == 3
    assert receive_slots(make_settings(max_image_bytes=200 * MiB), 200 * MiB) == 1
    assert max_calls(settings) == 100 + 64


# -- what large messages may hold --------------------------------------------------------------


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def send_at_once(target: str, message: bytes, calls: int, key: str | None) -> list[Any]:
    """``calls`` ModelInfer calls of the serialised ``message`` at the same time, each on its
    own connection; their status codes."""
    metadata = [("authorization", f"Bearer {key}")] if key else []
    codes: list[Any] = [None] * calls

    def call(index: int) -> None:
        options = [("grpc.max_send_message_length", 2 * len(message))]
        with grpc.insecure_channel(target, options=options) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=bytes,
                                        response_deserializer=bytes)  # fmt: skip
            try:
                infer(message, metadata=metadata, timeout=120)
                codes[index] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[index] = exc.code()

    threads = [threading.Thread(target=call, args=(index,)) for index in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return codes


@pytest.mark.slow
def test_large_messages_hold_no_more_than_the_limits_allow() -> None:
    """Sixteen 15 MiB calls at once (240 MiB): without the key nothing of them is read; with
    it, the server holds at most ``MAX_QUEUE_BYTES`` of admitted messages, the one being
    received (a receive slot: a quarter of ``MAX_QUEUE_BYTES``, at least one message) three
    times over (gRPC's buffers, the bytes, the parsed message), two being parsed twice over
    (the parse threads' copies), and 64 MiB besides."""
    image_bytes, queue_bytes = 16 * MiB, 64 * MiB
    env = {**BASE_ENV, "BATCHSERVE_API_KEY": KEY, "BATCHSERVE_MAX_IMAGE_BYTES": str(image_bytes),
           "BATCHSERVE_MAX_QUEUE_BYTES": str(queue_bytes)}  # fmt: skip
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    payload = 15 * MiB
    request.raw_input_contents.append(payload.to_bytes(4, "little") + b"\x00" * payload)
    message = request.SerializeToString()
    with UvicornProcess(env) as server:
        assert server.process is not None
        pid = server.process.pid
        before = peak_rss_mib(pid)
        refused = send_at_once(server.grpc_target, message, 16, key=None)
        assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 16
        unauthenticated = peak_rss_mib(pid) - before
        assert unauthenticated < 32, f"{unauthenticated:.0f} MiB for refused calls"
        before = peak_rss_mib(pid)
        answered = send_at_once(server.grpc_target, message, 16, key=KEY)
        # Not an image: refused once read, or by admission while others hold the bytes.
        assert set(answered) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
        limit = image_bytes / MiB + 0.0625
        bound = queue_bytes / MiB + 3 * limit + 2 * 2 * limit + 64
        grown = peak_rss_mib(pid) - before
        assert grown < bound, f"{grown:.0f} MiB held, bound {bound:.0f} MiB"


@pytest.mark.slow
def test_large_tensors_are_read_off_the_event_loop() -> None:
    """Typed ``contents`` and raw tensors of 7 million numbers each, eight calls at once, while
    ``/healthz`` is asked every 50 ms: it answers within two thirds of its probe's timeout (3 s).
    Parsing a message in C still holds the GIL for a moment on two busy cores; what this guards
    is reading elements as Python numbers on the event loop, which held it for many seconds."""
    env = {**BASE_ENV, "BATCHSERVE_MAX_IMAGE_BYTES": str(64 * MiB),
           "BATCHSERVE_MAX_QUEUE_BYTES": str(512 * MiB)}  # fmt: skip
    rng = np.random.default_rng(0)
    tensor = rng.standard_normal((48, 3, 224, 224)).astype(np.float32)
    pixels = rng.integers(0, 256, (16, 480, 320, 3), dtype=np.uint8)
    messages = []
    for name, datatype, array, field in (
        ("tensor", "FP32", tensor, "fp32_contents"),
        ("pixels", "UINT8", pixels, "uint_contents"),
    ):
        typed = service_pb2.ModelInferRequest(model_name=MODEL)
        entry = typed.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        getattr(entry.contents, field).extend(array.ravel().tolist())
        raw = service_pb2.ModelInferRequest(model_name=MODEL)
        raw.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        raw.raw_input_contents.append(array.tobytes())
        messages += [typed.SerializeToString(), raw.SerializeToString()]
    with UvicornProcess(env) as server:
        waits: list[float] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=10) as http:
                while not done.is_set():
                    started = time.perf_counter()
                    assert http.get("/healthz").status_code == 200
                    waits.append(time.perf_counter() - started)
                    time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            codes: list[Any] = []

            def call(message: bytes) -> None:
                codes.extend(send_at_once(server.grpc_target, message, 1, key=None))

            callers = [threading.Thread(target=call, args=(m,)) for m in messages * 2]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join()
        finally:
            done.set()
            prober.join()
    assert codes == [grpc.StatusCode.OK] * 8
    assert max(waits) < 2.0, f"/healthz waited {max(waits):.2f} s"


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_a_load_whose_client_gives_up_finishes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A reload of two versions (1 s each to build, 128 MiB each), its client's deadline at
    1.5 s: the load goes on without it, the two new versions serve, once each, and the memory
    of the old ones and of nothing else is held."""
    root = tmp_path / "models"
    add_model(root, "heavy", (1, 2), model="tests.models:ballast_from_env", compile="none",
              version_policy="all")  # fmt: skip
    env = {**BASE_ENV, "BATCHSERVE_MODEL_REPOSITORY": str(root),
           "BATCHSERVE_MODEL_CONTROL": "explicit", "BATCHSERVE_LOAD_MODELS": "heavy",
           "BATCHSERVE_TEST_BUILD_SECONDS": "1.0",
           "BATCHSERVE_TEST_BALLAST_MIB": "128"}  # fmt: skip
    with UvicornProcess(env) as server:
        assert server.process is not None
        client = grpcclient.InferenceServerClient(server.grpc_target)
        try:
            before = resident_mib(server.process.pid)
            gave_up = status_of(lambda: client.load_model("heavy", client_timeout=1.5))
            assert gave_up == "StatusCode.DEADLINE_EXCEEDED"

            def settled() -> bool:
                index = client.get_model_repository_index(as_json=True)["models"]
                return sorted((m["version"], m["state"]) for m in index) == [
                    ("1", "READY"), ("2", "READY"),
                ]  # fmt: skip

            time.sleep(1.0)  # the second version is building (or, cancelled, was)
            wait_for(settled, timeout=30)
            pid = server.process.pid
            with contextlib.suppress(AssertionError):  # until the old versions are freed
                wait_for(lambda: resident_mib(pid) - before < 64, timeout=20)
            after = resident_mib(pid)
            reply = client.infer("heavy", [image_input(PICTURES[:1])], model_version="2")
            assert reply.as_numpy("probabilities").shape == (1, 12)
            assert "loading heavy failed" not in server.read_output()
        finally:
            client.close()
    assert after - before < 64, f"{after - before:.0f} MiB more after the reload"

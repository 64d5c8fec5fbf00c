"""The real Triton HTTP client against a real uvicorn process: a program written for Triton
classifies an image against batchserve with only the URL and model name changed."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
from PIL import Image

from harness.servers import UvicornProcess
from tests import images
from tests.protocol_schemas import (
    INFERENCE_RESPONSE,
    MODEL_METADATA,
    MODEL_READY,
    SERVER_LIVE,
    SERVER_METADATA,
    SERVER_READY,
)

httpclient = pytest.importorskip("tritonclient.http")
utils = pytest.importorskip("tritonclient.utils")

MODEL = "color_classifier"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server() -> Iterator[UvicornProcess]:
    env = {
        "BATCHSERVE_MODEL": "tests.models:color_classifier",
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_PRECISION": "fp32",
        "BATCHSERVE_MAX_BATCH_SIZE": "8",
        "BATCHSERVE_LOG_LEVEL": "warning",
    }
    with UvicornProcess(env) as process:
        yield process


@pytest.fixture
def client(server: UvicornProcess) -> Iterator[Any]:
    triton = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    yield triton
    triton.close()


PICTURES = [images.jpeg(images.photo(220, 160, seed=seed)) for seed in range(3)]


def predict(server: UvicornProcess, data: bytes, k: int = 12) -> list[dict[str, Any]]:
    response = httpx.post(f"{server.url}/predict?top_k={k}", content=data,
                          headers={"content-type": "image/jpeg"})  # fmt: skip
    assert response.status_code == 200, response.text
    predictions: list[dict[str, Any]] = response.json()["predictions"]
    return predictions


def image_input(pictures: list[bytes], binary: bool = True) -> Any:
    tensor = httpclient.InferInput("image", [len(pictures)], "BYTES")
    if binary:
        tensor.set_data_from_numpy(np.array(pictures, dtype=np.object_), binary_data=True)
    else:  # raw bytes are not JSON strings: images in JSON travel base64-encoded
        encoded = [base64.b64encode(p).decode() for p in pictures]
        tensor.set_data_from_numpy(np.array(encoded, dtype=np.object_), binary_data=False)
    return tensor


def assert_matches_predict(server: UvicornProcess, probabilities: np.ndarray, data: bytes) -> None:
    expected = predict(server, data)
    assert int(np.argmax(probabilities)) == expected[0]["index"]
    for entry in expected:
        assert probabilities[entry["index"]] == pytest.approx(entry["score"], abs=1e-5)


def test_health_and_metadata(client: Any, server: UvicornProcess) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, model_version="1")
    assert not client.is_model_ready("other")
    server_metadata = client.get_server_metadata()
    jsonschema.validate(server_metadata, SERVER_METADATA)
    assert server_metadata["name"] == "batchserve"
    metadata = client.get_model_metadata(MODEL)
    jsonschema.validate(metadata, MODEL_METADATA)
    assert metadata["name"] == MODEL
    assert {tensor["name"] for tensor in metadata["inputs"]} == {"image", "pixels", "tensor"}
    for path, schema in (("/v2/health/live", SERVER_LIVE), ("/v2/health/ready", SERVER_READY),
                         (f"/v2/models/{MODEL}/ready", MODEL_READY)):  # fmt: skip
        jsonschema.validate(httpx.get(server.url + path).json(), schema)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_one_and_several_images(client: Any, server: UvicornProcess, binary: bool) -> None:
    for pictures in (PICTURES[:1], PICTURES):
        output = httpclient.InferRequestedOutput("probabilities", binary_data=binary)
        result = client.infer(MODEL, [image_input(pictures, binary)], outputs=[output],
                              request_id="order-7")  # fmt: skip
        response = result.get_response()
        jsonschema.validate(response, INFERENCE_RESPONSE)
        assert response["id"] == "order-7"
        probabilities = result.as_numpy("probabilities")
        assert probabilities.shape == (len(pictures), 12)
        for row, data in zip(probabilities, pictures, strict=True):
            assert_matches_predict(server, row, data)


def test_default_outputs_come_back_binary(client: Any, server: UvicornProcess) -> None:
    result = client.infer(MODEL, [image_input(PICTURES[:1])])  # asks binary_data_output
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 48
    assert_matches_predict(server, result.as_numpy("probabilities")[0], PICTURES[0])


def test_classification_extension(client: Any, server: UvicornProcess) -> None:
    output = httpclient.InferRequestedOutput("probabilities", binary_data=True, class_count=3)
    result = client.infer(MODEL, [image_input(PICTURES)], outputs=[output])
    classes = result.as_numpy("probabilities")
    assert classes.shape == (3, 3)
    for row, data in zip(classes, PICTURES, strict=True):
        expected = predict(server, data, k=3)
        for element, entry in zip(row, expected, strict=True):
            score, index, label = element.decode().split(":", 2)
            assert (int(index), label) == (entry["index"], entry["label"])
            assert float(score) == pytest.approx(entry["score"], abs=1e-5)


def test_priority_and_timeout(client: Any, server: UvicornProcess) -> None:
    result = client.infer(MODEL, [image_input(PICTURES[:1])], priority=1, timeout=10_000_000)
    assert_matches_predict(server, result.as_numpy("probabilities")[0], PICTURES[0])
    with pytest.raises(utils.InferenceServerException) as raised:
        client.infer(MODEL, [image_input(PICTURES[:1])], timeout=1)  # one microsecond
    assert raised.value.status() == "504"
    with pytest.raises(utils.InferenceServerException) as raised:
        client.infer(MODEL, [image_input(PICTURES[:1])], priority=99)
    assert raised.value.status() == "422"
    assert "priority" in raised.value.message()


def test_preprocessed_inputs(client: Any, server: UvicornProcess) -> None:
    rgb = np.asarray(Image.open(io.BytesIO(PICTURES[0])).convert("RGB"))[None]  # [1, H, W, 3]
    pixels = httpclient.InferInput("pixels", list(rgb.shape), "UINT8")
    pixels.set_data_from_numpy(rgb, binary_data=True)
    result = client.infer(MODEL, [pixels])
    assert_matches_predict(server, result.as_numpy("probabilities")[0], PICTURES[0])

    normalized = np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32)
    tensor = httpclient.InferInput("tensor", [2, 3, 224, 224], "FP32")
    tensor.set_data_from_numpy(normalized, binary_data=True)
    probabilities = client.infer(MODEL, [tensor]).as_numpy("probabilities")
    assert probabilities.shape == (2, 12)
    assert np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert not np.allclose(probabilities[0], probabilities[1])


def test_errors_reach_the_client_as_protocol_errors(client: Any) -> None:
    with pytest.raises(utils.InferenceServerException) as raised:
        client.infer("other", [image_input(PICTURES[:1])])
    assert raised.value.status() == "404"
    broken = httpclient.InferInput("image", [1], "BYTES")
    broken.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    with pytest.raises(utils.InferenceServerException) as raised:
        client.infer(MODEL, [broken])
    assert raised.value.status() == "400"


@pytest.fixture(scope="module")
def repository_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornProcess]:
    from tests.repository import add_model, add_version

    root = tmp_path_factory.mktemp("models")
    add_model(root, "colors", (1,), model="tests.models:color_classifier",
              version_policy="all")  # fmt: skip
    add_version(root, "colors", 2, scale=-1.0)
    add_model(root, "other", (1,), model="tests.models:color_classifier")
    env = {
        "BATCHSERVE_MODEL_REPOSITORY": str(root),
        "BATCHSERVE_MODEL_CONTROL": "explicit",
        "BATCHSERVE_LOAD_MODELS": "colors",
        "BATCHSERVE_LOG_LEVEL": "warning",
    }
    with UvicornProcess(env) as process:
        yield process


def test_the_repository_api_as_tritons_client_uses_it(repository_server: UvicornProcess) -> None:
    triton = httpclient.InferenceServerClient(url=repository_server.url.removeprefix("http://"))
    try:
        assert "model_repository" in triton.get_server_metadata()["extensions"]
        index = triton.get_model_repository_index()
        assert {(e["name"], e.get("version"), e["state"]) for e in index} == {
            ("colors", "1", "READY"), ("colors", "2", "READY"), ("other", None, "UNAVAILABLE"),
        }  # fmt: skip
        assert triton.is_model_ready("colors", "1")
        assert triton.is_model_ready("colors", "2")
        assert not triton.is_model_ready("colors", "3")
        assert not triton.is_model_ready("other")

        triton.load_model("other")
        assert triton.is_model_ready("other")
        pixels = np.frombuffer(PICTURES[0], dtype=np.uint8)
        inputs = [httpclient.InferInput("image", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([pixels.tobytes()], dtype=np.object_))
        for version in ("1", "2"):
            result = triton.infer("colors", inputs, model_version=version)
            assert result.get_response()["model_version"] == version
        assert triton.infer("other", inputs).get_response()["model_name"] == "other"

        triton.unload_model("colors")
        assert not triton.is_model_ready("colors")
        states = {(e["name"], e.get("version")): e["state"]
                  for e in triton.get_model_repository_index()}  # fmt: skip
        assert states[("colors", "1")] == states[("colors", "2")] == "UNAVAILABLE"
        with pytest.raises(utils.InferenceServerException, match="no version loaded"):
            triton.infer("colors", inputs)
        with pytest.raises(utils.InferenceServerException, match="unknown model"):
            triton.load_model("missing")
    finally:
        triton.close()

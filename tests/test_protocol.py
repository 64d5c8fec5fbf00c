"""The Open Inference Protocol through the real app: what it answers, and every way a body can
be malformed answered with a 4xx in the protocol's error shape."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import jsonschema
import orjson
import pytest

from app.errors import OverloadedError
from tests import images
from tests.checks import metric
from tests.conftest import make_settings, serve
from tests.protocol_schemas import ERROR, INFERENCE_RESPONSE, MODEL_METADATA, SERVER_METADATA

MODEL = "color_classifier"
INFER = f"/v2/models/{MODEL}/infer"


def request_json(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **extra})


def image_input(*pictures: bytes) -> dict[str, Any]:
    return {"name": "image", "datatype": "BYTES", "shape": [len(pictures)],
            "data": [base64.b64encode(p).decode() for p in pictures]}  # fmt: skip


def binary_body(header: dict[str, Any], tensor: bytes) -> tuple[bytes, dict[str, str]]:
    head = orjson.dumps(header)
    return head + tensor, {"inference-header-content-length": str(len(head))}


def length_prefixed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def assert_protocol_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    jsonschema.validate(body, ERROR)
    assert isinstance(body["error"], str)
    assert "Traceback" not in response.text
    message: str = body["error"]
    return message


async def test_metadata_and_a_json_inference(client: httpx.AsyncClient) -> None:
    server = (await client.get("/v2")).json()
    jsonschema.validate(server, SERVER_METADATA)
    assert {"binary_tensor_data", "classification"} <= set(server["extensions"])
    model = (await client.get(f"/v2/models/{MODEL}")).json()
    jsonschema.validate(model, MODEL_METADATA)
    assert model["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 12]}]
    assert (await client.get(f"/v2/models/{MODEL}/versions/1")).json() == model

    picture = images.jpeg(images.photo(200, 150, seed=3))
    response = await client.post(INFER, content=request_json(image_input(picture), id="req-7"))
    assert response.status_code == 200, response.text
    body = response.json()
    jsonschema.validate(body, INFERENCE_RESPONSE)
    assert (body["model_name"], body["model_version"], body["id"]) == (MODEL, "1", "req-7")
    (output,) = body["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("probabilities", "FP32",
                                                                     [1, 12])  # fmt: skip
    assert sum(output["data"]) == pytest.approx(1.0, abs=1e-5)
    predicted = await client.post("/predict?top_k=1", content=picture,
                                  headers={"content-type": "image/jpeg"})  # fmt: skip
    best = predicted.json()["predictions"][0]
    assert max(range(12), key=lambda i: output["data"][i]) == best["index"]
    assert max(output["data"]) == pytest.approx(best["score"], abs=1e-6)
    text = (await client.get("/metrics")).text
    assert metric(text, 'batchserve_requests_total{outcome="ok",route="v2_infer"}') == 1


async def test_binary_in_and_out_with_the_classification_extension(
    client: httpx.AsyncClient,
) -> None:
    pictures = [images.jpeg(images.photo(160, 120, seed=s)) for s in range(3)]
    tensor = length_prefixed(*pictures)
    header = {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [3],
                    "parameters": {"binary_data_size": len(tensor)}}],
        "outputs": [{"name": "probabilities",
                     "parameters": {"classification": 2, "binary_data": True}}],
    }  # fmt: skip
    body, headers = binary_body(header, tensor)
    response = await client.post(INFER, content=body, headers=headers)  # no Content-Type
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    head = orjson.loads(response.content[:length])
    jsonschema.validate(head, INFERENCE_RESPONSE)
    (output,) = head["outputs"]
    assert (output["datatype"], output["shape"]) == ("BYTES", [3, 2])
    raw = response.content[length:]
    assert len(raw) == output["parameters"]["binary_data_size"]
    strings, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        strings.append(raw[offset + 4 : offset + 4 + size].decode())
        offset += 4 + size
    assert len(strings) == 6
    for row, picture in enumerate(pictures):
        expected = (await client.post("/predict?top_k=2", content=picture,
                                      headers={"content-type": "image/jpeg"})).json()  # fmt: skip
        for entry, text in zip(expected["predictions"], strings[2 * row : 2 * row + 2],
                               strict=True):  # fmt: skip
            score, index, label = text.split(":", 2)
            assert (int(index), label) == (entry["index"], entry["label"])
            assert float(score) == pytest.approx(entry["score"], abs=1e-5)


MALFORMED: list[tuple[str, bytes, dict[str, str], int]] = [
    ("not JSON", b"{nope", {}, 400),
    ("not an object", b"[1, 2]", {}, 422),
    ("no inputs", b'{"inputs": []}', {}, 422),
    ("nested JSON bomb", b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400),
    ("data nested deeper than the shape", request_json(
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": [[["aGk="]]]}), {}, 422),
    ("data that does not fill the shape", request_json(
        {"name": "image", "datatype": "BYTES", "shape": [2], "data": ["aGk="]}), {}, 422),
    ("wrong datatype for the input", request_json(
        {"name": "image", "datatype": "FP32", "shape": [1], "data": [1.0]}), {}, 422),
    ("unknown datatype", request_json(
        {"name": "image", "datatype": "FP64", "shape": [1], "data": [1.0]}), {}, 422),
    ("not base64", request_json(
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["%%%"]}), {}, 422),
    ("UINT8 out of range", request_json(
        {"name": "pixels", "datatype": "UINT8", "shape": [1, 8, 8, 3], "data": [300] * 192}),
        {}, 422),
    ("negative dimension", request_json(
        {"name": "image", "datatype": "BYTES", "shape": [-1], "data": []}), {}, 422),
    ("two inputs", request_json(image_input(b"x"), image_input(b"y")), {}, 422),
    ("unknown output", request_json(image_input(b"x"), outputs=[{"name": "logits"}]), {}, 422),
    ("classification too large", request_json(
        image_input(b"x"), outputs=[{"name": "probabilities",
                                     "parameters": {"classification": 13}}]), {}, 422),
    ("priority out of range", request_json(image_input(b"x"), parameters={"priority": 9}),
     {}, 422),
    ("header length past the body", b'{"inputs": []}',
     {"inference-header-content-length": "999"}, 400),
    ("header length not a number", b'{"inputs": []}',
     {"inference-header-content-length": "many"}, 400),
]  # fmt: skip


def lying_binary_size(claimed: int, sent: int) -> tuple[bytes, dict[str, str]]:
    header = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                          "parameters": {"binary_data_size": claimed}}]}  # fmt: skip
    return binary_body(header, length_prefixed(b"\xff\xd8" * ((sent - 4) // 2)))


@pytest.mark.parametrize(("name", "body", "headers", "status"), MALFORMED,
                         ids=[case[0] for case in MALFORMED])  # fmt: skip
async def test_malformed_bodies_get_a_4xx(
    client: httpx.AsyncClient, name: str, body: bytes, headers: dict[str, str], status: int
) -> None:
    assert_protocol_error(await client.post(INFER, content=body, headers=headers), status)


@pytest.mark.parametrize(("claimed", "sent"), [(100, 20), (20, 100), (3, 20)])
async def test_lying_binary_data_sizes_get_a_422(
    client: httpx.AsyncClient, claimed: int, sent: int
) -> None:
    body, headers = lying_binary_size(claimed, sent)
    assert_protocol_error(await client.post(INFER, content=body, headers=headers), 422)


async def test_protocol_errors_for_images_models_and_limits() -> None:
    settings = make_settings(api_key="k" * 16, max_image_bytes=4096, max_queue_bytes=4096)
    auth = {"authorization": "Bearer " + "k" * 16}
    async with serve(settings) as (_, client):
        message = assert_protocol_error(
            await client.post(INFER, content=request_json(image_input(b"not an image")),
                              headers=auth), 400)  # fmt: skip
        assert "not a recognised image" in message
        assert_protocol_error(await client.post("/v2/models/other/infer", content=b"{}",
                                                headers=auth), 404)  # fmt: skip
        assert_protocol_error(await client.get(f"/v2/models/{MODEL}/versions/2", headers=auth),
                              404)  # fmt: skip
        assert_protocol_error(await client.post(INFER, content=b"{}"), 401)  # the key first
        assert_protocol_error(await client.get("/v2", headers={}), 401)
        big = images.jpeg(images.photo(400, 300), quality=95)
        assert_protocol_error(await client.post(INFER, content=request_json(image_input(big)),
                                                headers=auth), 413)  # fmt: skip
        # Health stays open, for probes.
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert (await client.get("/v2/health/ready")).json() == {"ready": True}
        ready = await client.get(f"/v2/models/{MODEL}/ready")
        assert ready.json() == {"name": MODEL, "ready": True}


async def test_each_image_of_a_request_counts_against_the_queue() -> None:
    settings = make_settings(max_images_per_request=3, max_queue_size=4)
    pictures = [images.jpeg(images.photo(64, 48, seed=seed)) for seed in range(4)]
    async with serve(settings) as (app, client):
        too_many = await client.post(INFER, content=request_json(image_input(*pictures)))
        assert "1 to 3 images (MAX_IMAGES_PER_REQUEST), not 4" in assert_protocol_error(
            too_many, 422
        )
        three = await client.post(INFER, content=request_json(image_input(*pictures[:3])))
        assert three.status_code == 200, three.text
        # Three images take three of the four places: a second such request cannot be admitted
        # while the first holds them, wherever it is (read, decoded, queued).
        predictor = app.state.server.predictor
        first, second = predictor.admission.admit(MODEL), predictor.admission.admit(MODEL)
        try:
            first.count_images(3)
            with pytest.raises(OverloadedError):
                second.count_images(2)
        finally:
            first.close()
            second.close()


async def test_a_deadline_is_a_504_in_the_protocol_shape(client: httpx.AsyncClient) -> None:
    body = request_json(image_input(images.jpeg()), parameters={"timeout": 1})  # 1 µs
    assert_protocol_error(await client.post(INFER, content=body), 504)

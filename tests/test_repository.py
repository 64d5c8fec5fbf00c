"""Several models in one server: the repository on disk, versions and their policy, routes per
model and version, model control, reload without downtime, and one device shared fairly."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.serving.repository import RepositoryError, read_model, single_model
from tests import images
from tests.checks import metric
from tests.conftest import make_settings, serve
from tests.fakes import until
from tests.models import OverlapProbe
from tests.repository import add_model, add_version, colour_repository, toml

JPEG = {"content-type": "image/jpeg"}
PHOTO = images.jpeg(images.photo(200, 150, seed=3))


# -- the repository on disk ----------------------------------------------------------------


def test_a_model_and_its_versions_are_read_with_their_settings(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("\n".join(f"class {i}" for i in range(12)) + "\n")
    add_model(tmp_path, "colors", (1, 2, 3), model="tests.models:color_classifier",
              labels="../labels.txt", version_policy="latest", latest_versions=2,
              max_batch_size=16)  # fmt: skip
    add_version(tmp_path, "colors", 3, scale=2.0, max_batch_size=4)
    base = make_settings(max_queue_size=77)
    spec = read_model(tmp_path, "colors", base)
    assert [v.version for v in spec.versions] == [3, 2]  # the latest two, highest first
    three, two = spec.versions
    assert (three.config.max_batch_size, two.config.max_batch_size) == (4, 16)
    assert three.config.weights == str(tmp_path / "colors" / "3" / "model.pt")
    assert two.config.weights == "none"
    # Relative paths resolve against the folder of the file that names them.
    assert two.config.labels == tmp_path / "colors" / ".." / "labels.txt"
    # The process's settings are shared; a model key the config leaves out takes its default,
    # not the environment's.
    assert three.config.max_queue_size == 77
    assert three.config.top_k == 5


@pytest.mark.parametrize(
    ("policy", "expected"),
    [({"version_policy": "all"}, [3, 2, 1]), ({"version_policy": [1, 3]}, [3, 1]), ({}, [3])],
)
def test_version_policies(tmp_path: Path, policy: dict[str, Any], expected: list[int]) -> None:
    add_model(tmp_path, "colors", (1, 2, 3), model="tests.models:color_classifier", **policy)
    versions = read_model(tmp_path, "colors", make_settings()).versions
    assert [v.version for v in versions] == expected


def test_every_problem_is_one_line_naming_the_file_and_key(tmp_path: Path) -> None:
    add_model(tmp_path, "broken", (1,), model="tests.models:color_classifier",
              max_batch_size=0, colour="red", version_policy=[1, 5])  # fmt: skip
    add_version(tmp_path, "broken", 1, precision="fp64")
    with pytest.raises(RepositoryError) as raised:
        read_model(tmp_path, "broken", make_settings())
    lines = str(raised.value).splitlines()
    config, override = (
        tmp_path / "broken" / "config.toml",
        tmp_path / "broken" / "1" / "config.toml",
    )
    assert any(line.startswith(f"{config}: unknown key 'colour'") for line in lines), lines
    assert any(line.startswith(f"{config}: version_policy names versions with no folder: [5]")
               for line in lines), lines  # fmt: skip
    assert any(line.startswith(f"{override}: precision:") for line in lines), lines
    assert any(line.startswith(f"{override}: max_batch_size:") for line in lines), lines
    (tmp_path / "broken" / "config.toml").write_text("model = [unclosed")
    with pytest.raises(RepositoryError, match="not readable TOML"):
        read_model(tmp_path, "broken", make_settings())


def test_without_a_repository_the_settings_are_the_one_model_version_1() -> None:
    spec = single_model(make_settings(model_name="mine"))
    assert (spec.name, [v.version for v in spec.versions]) == ("mine", [1])


# -- serving several models ------------------------------------------------------------------


async def predict(client: httpx.AsyncClient, query: str = "") -> httpx.Response:
    return await client.post(f"/predict{query}", content=PHOTO, headers=JPEG)


async def test_two_models_and_their_versions_from_one_process(tmp_path: Path) -> None:
    root = colour_repository(tmp_path)
    settings = make_settings(model_repository=root, default_model="colors")
    async with serve(settings) as (_, client):
        default = await predict(client)
        latest = await predict(client, "?model=colors")
        probe = await predict(client, "?model=probe&version=1")
        assert (default.json()["model"], default.json()["version"]) == ("colors", "2")
        assert latest.json() == default.json()
        assert (probe.json()["model"], probe.json()["version"]) == ("probe", "1")
        missing = await predict(client, "?model=colors&version=1")  # policy: latest only
        assert missing.status_code == 404, missing.text
        assert (await predict(client, "?model=nope")).status_code == 404
        v2 = await client.post("/v2/models/probe/versions/1/infer", json={
            "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                        "data": [base64.b64encode(PHOTO).decode()]}],
        })  # fmt: skip
        assert v2.status_code == 200, v2.text
        assert (v2.json()["model_name"], v2.json()["model_version"]) == ("probe", "1")
        assert (await client.get("/v2/models/colors/versions/2/ready")).status_code == 200
        assert (await client.get("/v2/models/colors/versions/1/ready")).status_code != 200
        listed = (await client.get("/v1/models")).json()
        text = (await client.get("/metrics")).text
    assert [(m["model"], m["version"]) for m in listed["models"]] == [
        ("colors", "2"),
        ("probe", "1"),
    ]
    assert {(e["name"], e["state"]) for e in listed["repository"]} == {
        ("colors", "READY"), ("probe", "READY"),
    }  # fmt: skip
    assert metric(text, 'batchserve_requests_total{model="colors",outcome="ok"}') == 2
    assert metric(text, 'batchserve_batch_size_count{model="probe",version="1"}') == 2


async def test_several_models_and_no_default_want_a_name(tmp_path: Path) -> None:
    async with serve(make_settings(model_repository=colour_repository(tmp_path))) as (_, c):
        response = await predict(c)
    assert response.status_code == 404
    assert "name a model" in response.json()["error"]["message"]


# -- model control ----------------------------------------------------------------------


async def test_explicit_control_loads_what_it_is_asked_to(tmp_path: Path) -> None:
    settings = make_settings(model_repository=colour_repository(tmp_path),
                             model_control="explicit", load_models=("probe",))  # fmt: skip
    async with serve(settings) as (_, client):
        index = (await client.post("/v2/repository/index")).json()
        assert {"name": "colors", "state": "UNAVAILABLE", "reason": "not loaded"} in index
        assert (await predict(client, "?model=colors")).status_code == 404
        loaded = await client.post("/v2/repository/models/colors/load", json={})
        assert loaded.status_code == 200, loaded.text
        assert (await predict(client, "?model=colors")).json()["version"] == "2"
        unloaded = await client.post(
            "/v2/repository/models/probe/unload", json={"parameters": {"unload_dependents": False}}
        )
        assert unloaded.status_code == 200, unloaded.text
        index = (await client.post("/v2/repository/index")).json()
        assert {"name": "probe", "version": "1", "state": "UNAVAILABLE",
                "reason": "unloaded"} in index  # fmt: skip
        assert (await predict(client, "?model=probe")).status_code == 404
        unknown = await client.post("/v2/repository/models/nope/load")
        assert unknown.status_code == 404
        assert "unknown model" in unknown.json()["error"]


async def test_without_explicit_control_the_api_does_not_load(tmp_path: Path) -> None:
    async with serve(make_settings(model_repository=colour_repository(tmp_path))) as (_, c):
        refused = await c.post("/v2/repository/models/colors/load")
        index = await c.post("/v2/repository/index")
    assert refused.status_code == 400
    assert "MODEL_CONTROL=explicit" in refused.json()["error"]
    assert index.status_code == 200


# -- reload without downtime -------------------------------------------------------------


async def test_a_reload_under_load_answers_every_request(tmp_path: Path) -> None:
    """Sixteen clients in a loop while version 2 is added and loaded: every request is
    answered 200; version 1 answers until the switch and version 2 after it: every request sent
    before the load began is answered by 1, every one sent after it returned by 2, and the
    answers of each client switch once, from 1 to 2, never back."""
    root = tmp_path / "models"
    add_model(root, "colors", (1,), model="tests.models:color_classifier")
    settings = make_settings(model_repository=root, model_control="explicit")
    sent: list[tuple[float, int, str]] = []  # (when sent, client, version answered)
    statuses: list[int] = []
    done = asyncio.Event()
    loaded_at = asyncio.get_running_loop().time() + 3600.0

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            response = await predict(client)
            statuses.append(response.status_code)
            if response.status_code == 200:
                sent.append((started, index, response.json()["version"]))
            if done.is_set() and started > loaded_at:
                return
            await asyncio.sleep(0.001)  # a quick refusal must not keep the loop to itself

    async with serve(settings) as (_, client):
        loop = asyncio.get_running_loop()
        clients = [asyncio.create_task(client_loop(client, index)) for index in range(16)]
        await asyncio.sleep(0.3)
        add_version(root, "colors", 2, scale=-1.0)  # the latest version now
        load_began = loop.time()
        response = await client.post("/v2/repository/models/colors/load")
        assert response.status_code == 200, response.text
        loaded_at = loop.time()
        done.set()
        await asyncio.wait_for(asyncio.gather(*clients), 60)
        index = (await client.post("/v2/repository/index")).json()
    assert set(statuses) == {200}
    before = [version for started, _, version in sent if started < load_began]
    after = [version for started, _, version in sent if started > loaded_at]
    assert before
    assert set(before) == {"1"}
    assert after
    assert set(after) == {"2"}
    for each in range(16):
        answers = [version for _, client_index, version in sorted(sent) if client_index == each]
        switched = answers.index("2")
        assert set(answers[:switched]) == {"1"}
        assert set(answers[switched:]) == {"2"}, f"client {each} went back to version 1"
    assert [(e["version"], e["state"]) for e in index] == [("2", "READY")]


async def test_a_failed_load_leaves_the_serving_version_alone(tmp_path: Path) -> None:
    root = tmp_path / "models"
    add_model(root, "colors", (1,), model="tests.models:color_classifier")
    add_version(root, "colors", 2, scale=-1.0)
    settings = make_settings(model_repository=root, model_control="explicit")
    async with serve(settings) as (_, client):
        assert (await predict(client)).json()["version"] == "2"
        broken = add_version(root, "colors", 3)
        (broken / "model.pt").write_bytes(b"not a checkpoint")
        refused = await client.post("/v2/repository/models/colors/load")
        assert refused.status_code == 400
        assert "cannot load 'colors'" in refused.json()["error"]
        after = await predict(client)
        assert (after.status_code, after.json()["version"]) == (200, "2")
        # A config that does not validate is refused the same way.
        shutil.rmtree(broken)
        (root / "colors" / "config.toml").write_text(toml({"max_batch_size": -1}))
        refused = await client.post("/v2/repository/models/colors/load")
        assert refused.status_code == 400
        assert "max_batch_size" in refused.json()["error"]
        assert (await predict(client)).json()["version"] == "2"


async def test_unloading_answers_the_requests_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "models"
    add_model(root, "probe", (1,), model="tests.models:overlap_probe", compile="none")
    settings = make_settings(model_repository=root, model_control="explicit")
    async with serve(settings) as (_, client):
        OverlapProbe.seconds = 0.05
        try:
            in_flight = [asyncio.create_task(predict(client)) for _ in range(12)]
            await asyncio.sleep(0.05)
            unloaded = await client.post("/v2/repository/models/probe/unload")
            answers = await asyncio.gather(*in_flight)
        finally:
            OverlapProbe.seconds = 0.0
        after = await predict(client, "?model=probe")
    assert unloaded.status_code == 200
    assert [answer.status_code for answer in answers] == [200] * 12
    assert after.status_code == 404


# -- one device, several models ----------------------------------------------------------


async def test_two_models_on_one_cpu_never_run_forward_passes_at_once(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for name in ("first", "second"):
        add_model(root, name, (1,), model="tests.models:overlap_probe", compile="none")
    async with serve(make_settings(model_repository=root)) as (_, client):
        OverlapProbe.seconds, OverlapProbe.most, OverlapProbe.passes = 0.01, 0, 0
        try:
            answers = await asyncio.gather(*(
                predict(client, f"?model={name}") for name in ("first", "second") * 16
            ))  # fmt: skip
        finally:
            OverlapProbe.seconds = 0.0
    assert {answer.status_code for answer in answers} == {200}
    assert OverlapProbe.passes >= 2
    assert OverlapProbe.most == 1


async def test_requests_for_unknown_models_do_not_list_the_repository(tmp_path: Path) -> None:
    """The repository's models are listed by the index, a load or an unload, not by every
    request or readiness call that names a model (open to anyone, key or none)."""
    root = colour_repository(tmp_path)
    settings = make_settings(model_repository=root, model_control="explicit",
                             load_models=("colors",))  # fmt: skip
    async with serve(settings) as (_, client):
        add_model(root, "late", (1,), model="tests.models:color_classifier")
        for _ in range(2):
            unknown = await predict(client, "?model=late")
            assert "unknown model 'late'" in unknown.json()["error"]["message"]
            assert (await client.get("/v2/models/late/ready")).status_code == 404
        await client.post("/v2/repository/index")
        listed = await predict(client, "?model=late")
        assert "'late' has no version loaded" in listed.json()["error"]["message"]


def squeezenet_checkpoint(seed: int, model: str = "squeezenet1_1") -> bytes:
    """A model's random weights (by default a ten-class squeezenet1_1's), as ``torch.save``
    writes them."""
    import io

    from torchvision.models import get_model

    kwargs: dict[str, Any] = {"num_classes": 10} if model == "squeezenet1_1" else {
        "weights_backbone": None}  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = get_model(model, weights=None, **kwargs)
    if model != "squeezenet1_1":  # a detector: weights whose boxes differ
        from harness.reference import decoded
        from harness.spread import spread

        photo = decoded(PHOTO).float() / 255
        spread(built, lambda each: each([photo]), seed, class_spread=1.3)
    buffer = io.BytesIO()
    torch.save(built.state_dict(), buffer)
    return buffer.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["squeezenet1_1", "ssdlite320_mobilenet_v3_large"])
async def test_a_checkpoint_replaced_under_its_size_and_mtime_serves_its_new_weights(
    tmp_path: Path, model: str
) -> None:
    """``rsync -a`` and ``tar`` keep modification times: a reload after the file changed must
    serve what the file now holds, not what a card or artefact remembers of the old one, for a
    classifier served from a kept artefact and for a detector, whose module is always built."""
    root = tmp_path / "models"
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class {index}" for index in range(10)) + "\n")
    options: dict[str, Any] = {"labels": str(labels)} if model == "squeezenet1_1" else {
        "min_score": 0.0}  # fmt: skip
    for name in ("net", "fresh"):
        add_model(root, name, (1,), model=model, **options)
    old, new = squeezenet_checkpoint(1, model), squeezenet_checkpoint(2, model)
    assert len(old) == len(new)
    assert old != new
    weights = root / "net" / "1" / "model.pt"
    weights.write_bytes(old)
    (root / "fresh" / "1" / "model.pt").write_bytes(new)  # the same weights at a new path
    settings = make_settings(model_repository=root, model_control="explicit",
                             load_models=("net",),
                             artifacts_dir=tmp_path / "artifacts")  # fmt: skip
    async with serve(settings) as (_, client):
        answer = "predictions" if model == "squeezenet1_1" else "detections"
        before = (await predict(client, "?model=net&top_k=10")).json()[answer]
        stat = weights.stat()
        weights.write_bytes(new)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (
            stat.st_size, stat.st_mtime_ns,
        )  # fmt: skip
        for name in ("net", "fresh"):
            loaded = await client.post(f"/v2/repository/models/{name}/load")
            assert loaded.status_code == 200, loaded.text
        after = (await predict(client, "?model=net&top_k=10")).json()[answer]
        expected = (await predict(client, "?model=fresh&top_k=10")).json()[answer]
    assert after
    assert after != before
    assert [entry["index"] for entry in after] == [entry["index"] for entry in expected]
    for got, want in zip(after, expected, strict=True):
        assert got["score"] == pytest.approx(want["score"], abs=1e-5)
        assert got.get("box") == pytest.approx(want.get("box"), abs=1e-3)


async def test_a_request_still_decoding_when_the_drain_ends_is_answered_not_ready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "models"
    add_model(root, "colors", (1,), model="tests.models:color_classifier")
    settings = make_settings(model_repository=root, model_control="explicit",
                             load_models=("colors",), drain_timeout_s=0)  # fmt: skip
    async with serve(settings) as (app, client):
        predictor = app.state.server.predictor
        held = threading.Event()
        # Every decode thread busy: the request waits for one, admitted and not yet queued.
        blockers = [asyncio.ensure_future(predictor.decoding.run(0, held.wait))
                    for _ in range(settings.decode_threads)]  # fmt: skip
        request = asyncio.ensure_future(predict(client))
        await until(lambda: predictor.decoding.waiting == 1)
        unloaded = await client.post("/v2/repository/models/colors/unload")
        assert unloaded.status_code == 200
        held.set()
        await asyncio.gather(*blockers)
        answer = await request
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "not_ready"
    assert "unhandled" not in caplog.text.lower()

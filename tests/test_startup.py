"""Start-up: its phases are measured and shown, a checked artefact is not checked again, and
only the first batch size warms up before ready on a CPU."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.engine import InferenceEngine, build_engine
from app.engine.checks.startup_check import CHECK_RECORD
from app.engine.model.kept import code_fingerprint
from app.startup import MODEL_PHASES, Phases, process_age_s
from harness.promtext import parse, value
from tests import images
from tests.conftest import make_settings, serve
from tests.fakes import until


def test_the_process_age_is_read_from_the_system() -> None:
    age = process_age_s()
    assert age is not None
    assert 0 < age < 24 * 3600


async def test_phases_are_shown_per_model_and_scraped_per_phase() -> None:
    async with serve(make_settings(warmup="all")) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
        scraped = parse((await client.get("/metrics")).text)
    phases = model["startup_s"]
    assert set(phases["model"]) >= {"weights", "compile", "warmup", "batcher"}
    assert set(phases["model"]) <= set(MODEL_PHASES)
    assert set(phases["process"]) >= {"imports", "server", "ready", *phases["model"]}
    for phase, seconds in phases["process"].items():
        assert seconds >= 0
        assert value(scraped, "batchserve_startup_seconds", phase=phase) == pytest.approx(
            seconds, abs=1e-3
        )
    # The process's age at ready covers its phases (uvicorn's own bind is in none of them).
    assert phases["process"]["ready"] >= phases["process"]["imports"]


async def test_on_a_cpu_only_the_first_size_warms_up_before_ready_and_the_rest_when_idle() -> None:
    settings = make_settings(max_batch_size=8)
    async with serve(settings) as (app, client):
        version = app.state.server.predictor.registry.models["color_classifier"][1]
        engine = version.engine
        assert engine.buckets == (1, 2, 4, 8)
        assert version.phases.seconds["warmup"] > 0
        # Ready with the first size warmed; it answers at once while the rest follow.
        answer = await client.post(
            "/predict", content=images.jpeg(), headers={"content-type": "image/jpeg"}
        )
        assert answer.status_code == 200
        timings = version.batcher.timings
        await until(lambda: set(engine.warmup_timings) == {1, 2, 4, 8}, limit_s=30)
        # Each size's time seeds the batcher's model once it is measured.
        await until(lambda: timings.estimate(8) == engine.warmup_timings[8])


async def test_with_warmup_all_every_size_is_warm_before_ready() -> None:
    async with serve(make_settings(max_batch_size=8, warmup="all")) as (app, _):
        version = app.state.server.predictor.registry.models["color_classifier"][1]
        assert set(version.engine.warmup_timings) == {1, 2, 4, 8}


def test_a_phase_inside_another_counts_as_its_own_only() -> None:
    # A precision's start-up check runs while the precisions are being compiled and measured.
    phases = Phases()
    with phases.phase("compile"):
        time.sleep(0.02)
        with phases.phase("check"):
            time.sleep(0.05)
    assert phases.seconds["check"] >= 0.05
    assert 0.02 <= phases.seconds["compile"] < 0.05


def checked_now(engine: InferenceEngine) -> bool:
    """Whether the engine's start-up check ran now (not taken from a kept verdict)."""
    assert engine.check is not None
    return not engine.check.get("reused")


def test_a_runtime_artefact_checked_before_is_not_checked_again(tmp_path: Path) -> None:
    settings = make_settings(backend="onnxruntime", artifacts_dir=tmp_path / "artifacts")
    first = build_engine(settings.own_model())
    assert first.check is not None
    assert first.check["passed"]
    assert not first.check.get("reused")
    record = Path(first.backend.describe()["artifact"]).parent / CHECK_RECORD
    assert record.is_file()

    again = build_engine(settings.own_model())
    assert again.check is not None
    assert not checked_now(again)
    assert again.check["top1_agreement"] == first.check["top1_agreement"]

    # Another artefact (the same path, other bytes): the verdict does not hold for it.
    import onnx

    artefact = Path(again.backend.describe()["artifact"])
    model = onnx.load(str(artefact))
    model.doc_string = "another export"
    onnx.save(model, str(artefact))
    assert checked_now(build_engine(settings.own_model()))


async def test_a_runtime_backend_makes_the_warm_up_images_while_it_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ONNX Runtime and OpenVINO compile with the GIL released: the warm-up's images are made
    # on the other core meanwhile, not after the build.
    from app.engine import warmup as warmup_module
    from app.serving import version as version_module

    asked = threading.Event()
    overlapped: list[bool] = []

    def build(*args: Any, **kwargs: Any) -> Any:
        overlapped.append(asked.wait(10))
        return build_engine(*args, **kwargs)  # the real one, from app.engine

    def made(count: int = 8) -> tuple[bytes, ...]:
        asked.set()
        return warmup_module.warmup_images(count)

    monkeypatch.setattr(version_module, "build_engine", build)
    monkeypatch.setattr(version_module, "warmup_images", made)
    settings = make_settings(backend="onnxruntime", artifacts_dir=tmp_path / "artifacts")
    async with serve(settings) as (_, client):
        answer = await client.post(
            "/predict", content=images.jpeg(), headers={"content-type": "image/jpeg"}
        )
    assert answer.status_code == 200
    assert overlapped == [True]


def test_an_artefact_hashed_ahead_is_not_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start-up check's binding takes the hash begun while the runtime compiled.
    from app.engine.int8 import int8_report
    from app.engine.model.artifacts import file_sha256

    model = tmp_path / "model.xml"
    model.write_bytes(b"<net/>" * 1000)
    model.with_suffix(".bin").write_bytes(bytes(range(256)) * 4000)
    expected = int8_report.artifact_digest(model)
    hashed: list[tuple[Path, ...]] = []

    def counted(*paths: Path) -> str:
        hashed.append(paths)
        return file_sha256(*paths)

    monkeypatch.setattr(int8_report, "file_sha256", counted)
    int8_report.digest_ahead(model)
    assert int8_report.artifact_digest(model) == expected
    assert hashed == [(model, model.with_suffix(".bin"))]


def test_an_artefact_written_again_after_its_hash_began_is_hashed_again(tmp_path: Path) -> None:
    from app.engine.int8 import int8_report

    model = tmp_path / "model.onnx"
    model.write_bytes(b"first export")
    int8_report.digest_ahead(model)
    for thread in threading.enumerate():  # the first bytes hashed
        if thread.name == "artefact-digest":
            thread.join()
    model.write_bytes(b"another export, longer")
    assert int8_report.artifact_digest(model) == hashlib.sha256(model.read_bytes()).hexdigest()


def test_a_read_only_cache_still_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from app.engine.model import artifacts

    settings = make_settings(backend="onnxruntime", artifacts_dir=tmp_path / "artifacts")
    first = build_engine(settings.own_model())
    record = Path(first.backend.describe()["artifact"]).parent / CHECK_RECORD
    record.unlink()

    def read_only(path: Path, data: Any) -> None:  # as a volume mounted read-only (root
        raise OSError(errno.EROFS, "Read-only file system", str(path))  # ignores chmod)

    monkeypatch.setattr(artifacts, "write_json", read_only)
    engine = build_engine(settings.own_model())
    assert engine.check is not None
    assert engine.check["passed"]
    assert not record.exists()
    assert "the next start will do this work again" in caplog.text


async def test_an_unloaded_version_stops_warming_up() -> None:
    settings = make_settings(max_batch_size=64)
    async with serve(settings) as (app, _):
        registry = app.state.server.predictor.registry
        version = registry.models["color_classifier"][1]
        warming = version._warming
        assert warming is not None
        await version.unload(1.0)
        await asyncio.sleep(0)
        assert warming.cancelled() or warming.done()


TORCHVISION_MODEL = "squeezenet1_1"  # small, and its exports agree with eager PyTorch


@pytest.mark.parametrize(
    ("backend", "precision", "model"),
    [
        ("torch", "fp32", TORCHVISION_MODEL),
        # Random squeezenet and shufflenet weights leave top classes within 1e-7 of the next,
        # which bf16 flips on some CPUs; resnet18's lead by at least 0.0027 (bf16 moves 5e-4).
        ("torch", "bf16", "resnet18"),
        ("openvino", "fp32", TORCHVISION_MODEL),
    ],
)
def test_a_kept_artefact_serves_without_building_the_eager_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, precision: str, model: str
) -> None:
    """The second start of a torchvision model reads its card and the kept verdicts of its
    artefact (TorchScript's against eager in its dtype, and the start-up check against eager
    fp32 of TorchScript in bf16 and of OpenVINO): the model is never built, so torchvision is
    not even imported, and the answers are the first start's."""
    import subprocess
    import sys

    from app.engine import ImageRequest
    from app.engine.model import loading as loading_module
    from app.engine.model.cards import card_path

    settings = make_settings(model=model, weights="none", backend=backend,
                             precision=precision, artifacts_dir=tmp_path / "artifacts")  # fmt: skip
    first = build_engine(settings.own_model())
    if precision == "bf16":
        assert first.check is not None
        assert not first.check.get("reused")
    card = card_path(settings.own_model())
    assert card is not None
    assert card.is_file()

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the eager model was built")

    monkeypatch.setattr(loading_module, "_load_torchvision", never)
    again = build_engine(settings.own_model())
    assert again.backend.name == backend
    assert again.labels == first.labels
    assert again.transform == first.transform
    pictures = [images.jpeg(images.photo(320, 240, seed=seed)) for seed in range(3)]
    answers = [
        engine.run_batch([ImageRequest(engine.prepare(data), 3) for data in pictures])
        for engine in (first, again)
    ]
    for mine, theirs in zip(*answers, strict=True):
        assert not isinstance(mine, BaseException)
        assert not isinstance(theirs, BaseException)
        assert [c["index"] for c in mine.classes] == [c["index"] for c in theirs.classes]

    script = (
        # Where torchvision is imported, if it is: the failure then says who asked for it.
        "import sys, traceback, importlib.abc\n"
        "class Watch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchvision':\n"
        "            traceback.print_stack(file=sys.stderr)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "from app.engine import build_engine\nfrom app.settings import Settings\n"
        f"s = Settings(_env_file=None, model={model!r}, weights='none', "
        f"backend={backend!r}, precision={precision!r}, max_batch_size=8, "
        f"artifacts_dir={str(tmp_path / 'artifacts')!r})\n"
        "build_engine(s.own_model()).warmup((1,))\n"
        "assert 'torchvision' not in sys.modules, 'torchvision was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_card_that_no_longer_fits_its_weights_is_rebuilt_from_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A card that says other weights than the settings build (as a checkpoint rewritten in
    place with the same size and time would leave): the first time the module is needed (here:
    an artefact to export again), the model is built again from the checkpoint and exported
    under its own name, never under the card's, and the card is written anew."""
    import json
    import shutil

    from app.engine.model.cards import card_path

    settings = make_settings(model=TORCHVISION_MODEL, weights="none", backend="onnxruntime",
                             artifacts_dir=tmp_path / "artifacts")  # fmt: skip
    first = build_engine(settings.own_model())
    card = card_path(settings.own_model())
    assert card is not None
    kept = json.loads(card.read_text())
    card.write_text(json.dumps({**kept, "digest": "0" * 64}))
    shutil.rmtree(Path(first.backend.describe()["artifact"]).parent)
    with caplog.at_level("WARNING", logger="batchserve"):
        again = build_engine(settings.own_model())
    assert "building from the checkpoint" in caplog.text
    assert again.backend.describe()["artifact"] == first.backend.describe()["artifact"]
    assert json.loads(card.read_text())["digest"] == kept["digest"]


def test_a_factory_model_gets_no_card() -> None:
    from app.engine.model.cards import card_path

    assert (
        card_path(make_settings().own_model()) is None
    )  # its code may change under the same settings


def test_a_kept_verdict_holds_only_for_the_options_and_code_that_made_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(backend="onnxruntime", artifacts_dir=tmp_path / "artifacts",
                             torch_threads=1)  # fmt: skip
    first = build_engine(settings.own_model())
    record = Path(first.backend.describe()["artifact"]).parent / CHECK_RECORD
    kept = json.loads(record.read_text())
    assert kept["bound_to"]["options"]["intra_op_threads"] == 1
    assert kept["bound_to"]["code"] == code_fingerprint()

    assert not checked_now(build_engine(settings.own_model()))  # the same: believed
    two = make_settings(backend="onnxruntime", artifacts_dir=tmp_path / "artifacts",
                        torch_threads=2)  # fmt: skip
    assert checked_now(build_engine(two.own_model()))
    record.write_text(json.dumps({**kept, "bound_to": {**kept["bound_to"], "code": "older"}}))
    assert checked_now(build_engine(settings.own_model()))
    record.write_text(json.dumps({"bound_to": kept["bound_to"]}))  # no report: unreadable
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        assert checked_now(build_engine(settings.own_model()))
    assert "ignoring the unreadable start-up check" in caplog.text

"""INT8 on every CPU: the CPU's INT8 class, the gate's figures, the recipes tried, and the
report that is believed only where it was judged."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cpus import available_cpus, cpu_model
from app.engine import build_engine
from app.engine.checks.gate import CHECK_BOUNDS, compare, verdict
from app.engine.errors import StartupError, UngatedModelError
from app.engine.int8.int8_class import Int8Class, classify, cpu_flags, this_cpu
from app.engine.int8.int8_report import GATE_IMAGES
from app.engine.int8.quantize import build_int8
from app.engine.int8.quantize_onnx import recipe_order
from app.engine.machine import fixed_rates
from app.engine.model.artifacts import REPORT, write_json
from app.engine.model.kept import code_fingerprint
from app.settings import Settings
from tests import images
from tests.conftest import make_settings, serve

RECORDED = Path(__file__).parent / "cpuinfo"
CONV_MODEL = "tests.models:conv_color_classifier"
JPEG = {"content-type": "image/jpeg"}


@pytest.mark.parametrize(
    ("recorded", "machine", "expected"),
    [
        ("sapphire-rapids.txt", "x86_64", Int8Class("amx", saturates=False)),
        ("cascade-lake.txt", "x86_64", Int8Class("avx512-vnni", saturates=False)),
        ("alder-lake.txt", "x86_64", Int8Class("avx-vnni", saturates=False)),
        ("skylake-sp.txt", "x86_64", Int8Class("avx512", saturates=True)),
        ("epyc-rome.txt", "x86_64", Int8Class("avx2", saturates=True)),
        ("graviton3.txt", "aarch64", Int8Class("arm-i8mm", saturates=False)),
        ("graviton2.txt", "aarch64", Int8Class("arm-dotprod", saturates=False)),
        ("cortex-a72.txt", "aarch64", Int8Class("arm", saturates=False)),
    ],
)
def test_the_int8_class_follows_the_recorded_cpu_flags(
    recorded: str, machine: str, expected: Int8Class
) -> None:
    assert classify(cpu_flags((RECORDED / recorded).read_text()), machine) == expected


def test_every_recorded_cpu_has_a_model_of_its_own() -> None:
    """What keys kept decisions per CPU: on Arm, where ``/proc/cpuinfo`` names no model, the
    core's implementer, part and features stand for it."""
    models = {path.name: cpu_model(path.read_text()) for path in RECORDED.iterdir()}
    assert len(set(models.values())) == len(models), models
    assert models["graviton2.txt"].startswith("Arm: CPU implementer 0x41")
    assert "CPU part 0xd0c" in models["graviton2.txt"]
    assert models["epyc-rome.txt"] == "AMD EPYC 7B12"


def test_an_unknown_cpu_is_assumed_to_saturate() -> None:
    assert classify(set(), "x86_64") == Int8Class("x86", saturates=True)
    assert classify({"avx512_vnni"}, "riscv64").saturates


def test_the_recipes_follow_the_int8_class() -> None:
    assert recipe_order(saturates=True, layers=10)[:2] == ["qdq-w7", "qdq-w7-fp32x1"]
    assert recipe_order(saturates=False, layers=10) == [
        "qdq-w8", "qdq-w8-fp32x1", "qdq-w8-fp32x2", "qdq-w8-fp32x4",
    ]  # fmt: skip


# -- the gate's figures --------------------------------------------------------------------


def one_hot(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([list(row) for row in rows])


def test_a_candidate_without_an_answer_agrees_with_nothing() -> None:
    reference = one_hot([0.7, 0.2, 0.1, 0.0], [0.1, 0.8, 0.1, 0.0])
    flat = torch.full((2, 4), 0.25)  # what a broken INT8 model gives: every class the same
    figures = compare(reference, flat)
    assert figures["top1_agreement"] == 0
    assert figures["plausible_top1"] == 0
    assert figures["confident_top1_agreement"] == 0


def test_where_the_reference_has_no_answer_only_the_probabilities_compare() -> None:
    # Random weights can make every class equal (mobilenet_v3_small's are): the same function,
    # exported, must not fail its check for the top class that neither side has.
    flat = torch.full((2, 4), 0.25)
    figures = compare(flat, flat.clone())
    assert figures["answered_images"] == 0
    assert figures["top1_agreement"] == figures["plausible_top1"] == 1.0
    assert not verdict(figures, CHECK_BOUNDS["fp32"])
    # An image the reference answers still counts, and a flat candidate misses it.
    reference = torch.cat([one_hot([0.7, 0.2, 0.1, 0.0]), flat[:1]])
    figures = compare(reference, flat)
    assert figures["answered_images"] == 1
    assert figures["top1_agreement"] == 0


def test_only_clear_answers_count_as_confident_and_near_ties_as_plausible() -> None:
    reference = one_hot(
        [0.52, 0.46, 0.02, 0.0],  # over one half, but a hesitation between two classes
        [0.90, 0.05, 0.05, 0.0],  # a clear answer
        [0.40, 0.25, 0.25, 0.1],  # no clear answer
    )
    candidate = one_hot([0.46, 0.52, 0.02, 0.0], [0.88, 0.07, 0.05, 0.0],
                        [0.20, 0.20, 0.20, 0.4])  # fmt: skip
    figures = compare(reference, candidate)
    assert figures["confident_images"] == 1
    assert figures["confident_top1_agreement"] == 1.0
    assert figures["top1_agreement"] == pytest.approx(1 / 3)
    assert figures["plausible_top1"] == pytest.approx(2 / 3)  # 0.46 is near 0.52; 0.1 of 0.4 not
    assert figures["mean_total_variation"] == pytest.approx((0.06 + 0.02 + 0.3) / 3)


# -- building, and believing the report ---------------------------------------------------


def photo_folder(tmp_path: Path, count: int, name: str = "calibration") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for seed in range(count):
        (folder / f"{seed:02d}.jpg").write_bytes(images.jpeg(images.photo(240, 180, seed=seed)))
    return folder


def int8_settings(tmp_path: Path, backend: str, **overrides: Any) -> Settings:
    return make_settings(model=CONV_MODEL, backend=backend, precision="int8",
                         artifacts_dir=tmp_path / "artifacts", **overrides)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An INT8 model of the conv classifier for ONNX Runtime, built once; tests copy it."""
    tmp_path = tmp_path_factory.mktemp("int8")
    settings = int8_settings(tmp_path, "onnxruntime", calibration_dir=photo_folder(tmp_path, 10))
    engine = build_engine(settings.own_model())
    return tmp_path / "artifacts", Path(engine.backend.describe()["artifact"])


@pytest.fixture
def artefacts(built: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the built artefacts, and the path of the INT8 model in it."""
    import shutil

    root, model = built
    shutil.copytree(root, tmp_path / "artifacts")
    return tmp_path / "artifacts" / model.parent.name / model.name


def edit_report(model: Path, **changes: Any) -> None:
    report = json.loads((model.parent / REPORT).read_text())
    write_json(model.parent / REPORT, {**report, **changes})


def test_the_report_names_the_cpu_class_recipes_and_what_it_is_bound_to(
    built: tuple[Path, Path],
) -> None:
    report = json.loads((built[1].parent / REPORT).read_text())
    assert report["cpu_int8_class"] == this_cpu().name
    assert report["cpu"]["saturates"] == this_cpu().saturates
    assert report["passed"], report
    assert report["recipe"] == report["recipes"][-1]["recipe"]
    bits = 7 if this_cpu().saturates else 8
    assert report["recipes"][0]["recipe"] == f"qdq-w{bits}"
    for tried in report["recipes"]:
        assert tried["images_per_second"] > 0
        assert tried["fp32_images_per_second"] > 0
    # Calibration and gate kept apart: every other photo of ten, the gate's with variants.
    assert (report["calibration_photos"], report["gate_photos"]) == (5, 5)
    assert report["gate_images"] == 5 * 6
    assert len(list((built[1].parent / GATE_IMAGES).iterdir())) == 30
    assert report["preprocessing"]["crop_size"] == 224
    assert len(report["artifact_sha256"]) == 64
    assert report["runtime"].startswith("onnxruntime ")
    assert report["code"] == code_fingerprint()
    assert report["threads"] == available_cpus()


def judged_again(caplog: pytest.LogCaptureFixture) -> bool:
    return "judging the INT8 model" in caplog.text


async def test_a_report_that_holds_here_is_believed_and_shown(
    artefacts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = int8_settings(tmp_path, "onnxruntime")
    async with serve(settings) as (_, client):
        (model,) = (await client.get("/v1/models")).json()["models"]
    assert not judged_again(caplog)
    gate = model["backend"]["int8_gate"]
    assert gate["passed"]
    assert gate["judged_again"] is False
    assert gate["cpu_int8_class"] == this_cpu().name == model["cpu"]["int8_class"]
    assert gate["recipe"].startswith("qdq-w")


@pytest.mark.parametrize(
    "changes",
    [
        {"cpu_int8_class": "avx2" if this_cpu().name != "avx2" else "amx"},
        {"weights_digest": "0" * 64},
        {"artifact_sha256": "0" * 64},
        {"runtime": "onnxruntime 0.1"},
        {"preprocessing": {"crop_size": 200}},
        {"code": "0" * 16},
        {"threads": 97},
        {"top1_agreement": "all of them"},
    ],
    ids=["another-cpu-class", "another-model", "another-artefact", "another-runtime",
         "another-preprocessing", "other-code", "other-threads", "unreadable"],
)  # fmt: skip
def test_a_report_judged_elsewhere_is_judged_again_before_serving(
    artefacts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, changes: dict[str, Any]
) -> None:
    edit_report(artefacts, **changes, passed=True, max_probability_difference=0.99)
    settings = int8_settings(tmp_path, "onnxruntime")
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        engine = build_engine(settings.own_model())
    assert judged_again(caplog)
    gate = engine.backend.describe()["int8_gate"]
    assert gate["judged_again"] is True
    assert gate["max_probability_difference"] < 0.99  # measured now, not read


def test_stricter_bounds_in_the_settings_judge_again_and_can_refuse(
    artefacts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stricter = int8_settings(tmp_path, "onnxruntime", int8_gate_max_probability_difference=0.2)
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        build_engine(stricter.own_model())
    assert "stricter bounds (max_probability_difference)" in caplog.text
    impossible = int8_settings(tmp_path, "onnxruntime", int8_gate_max_mean_total_variation=0.0)
    with pytest.raises(UngatedModelError, match="mean total variation"):
        build_engine(impossible.own_model())


def test_passed_true_is_never_believed_over_the_figures(artefacts: Path, tmp_path: Path) -> None:
    edit_report(artefacts, passed=True, failures=[], max_probability_difference=0.9)
    settings = int8_settings(tmp_path, "onnxruntime")
    with pytest.raises(UngatedModelError, match=r"probability difference 0\.9 > 0\.25"):
        build_engine(settings.own_model())


def test_auto_lets_a_gated_int8_model_compete_and_never_an_ungated_one(
    artefacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Measured rates made up so that INT8 wins: the choice, not the CPU, is under test.
    machine = fixed_rates(lambda backend: 100.0 if backend.precision == "int8" else 10.0)
    settings = make_settings(model=CONV_MODEL, backend="auto", precision="auto",
                             artifacts_dir=artefacts.parent.parent)  # fmt: skip
    engine = build_engine(settings.own_model(), machine=machine)
    assert (engine.backend.name, engine.precision) == ("onnxruntime", "int8")
    decision = engine.backend.describe()["auto"]
    assert decision["precision"] == "int8"
    assert set(decision["rates"]) == {"torch", "onnxruntime", "openvino", "onnxruntime int8"}
    assert engine.backend.describe()["int8_gate"]["passed"]
    again = build_engine(settings.own_model(), machine=machine)  # kept: not measured again
    assert again.backend.describe()["auto"]["reused"]
    assert (again.backend.name, again.precision) == ("onnxruntime", "int8")

    # A gate that fails here: the INT8 model is no candidate (and a new decision is made).
    edit_report(artefacts, confident_top1_agreement=0.5)
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision != "int8"
    assert not any(name.endswith(" int8") for name in engine.backend.describe()["auto"]["rates"])


def test_int8_slower_than_fp32_is_not_served(artefacts: Path, tmp_path: Path) -> None:
    edit_report(artefacts, images_per_second=10.0, fp32_images_per_second=20.0)
    settings = int8_settings(tmp_path, "onnxruntime")
    with pytest.raises(UngatedModelError, match="slower than fp32"):
        build_engine(settings.own_model())


def test_an_ungated_model_that_disagrees_is_served_only_when_allowed(
    artefacts: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken INT8 artefact fails its gate (judged again: it is not the file the report
    judged) and the start-up check; with ALLOW_UNGATED_INT8 it serves anyway, loudly."""
    from app.engine.model.export import export_onnx
    from tests.models import ConvColorClassifier

    class Negated(ConvColorClassifier):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -super().forward(x)

    export_onnx(Negated(), (3, 224, 224), artefacts)
    settings = int8_settings(tmp_path, "onnxruntime")
    with pytest.raises(UngatedModelError):
        build_engine(settings.own_model())
    allowed = int8_settings(tmp_path, "onnxruntime", allow_ungated_int8=True)
    with caplog.at_level(logging.CRITICAL, logger="batchserve"):
        engine = build_engine(allowed.own_model())
    assert engine.check is not None
    assert not engine.check["passed"]
    assert "served anyway, ungated" in caplog.text


def test_a_report_that_cannot_be_believed_without_gate_images_is_refused(
    artefacts: Path, tmp_path: Path
) -> None:
    import shutil

    shutil.rmtree(artefacts.parent / GATE_IMAGES)
    edit_report(artefacts, cpu_int8_class="another")
    settings = int8_settings(tmp_path, "onnxruntime")
    with pytest.raises(UngatedModelError, match=r"build it again with `python -m app\.quantize"):
        build_engine(settings.own_model())


def test_too_few_gate_images_and_the_gate_refuses_to_judge(tmp_path: Path) -> None:
    settings = int8_settings(tmp_path, "onnxruntime")
    with pytest.raises(StartupError, match=r"at least 30 images \(INT8_GATE_MIN_IMAGES\)"):
        build_int8(
            settings.own_model(), _loaded(settings), photo_folder(tmp_path, 8)
        )  # 4 held out: 24


def test_a_gate_folder_judges_instead_of_the_held_out_half(tmp_path: Path) -> None:
    settings = int8_settings(tmp_path, "openvino")
    path = build_int8(settings.own_model(), _loaded(settings), photo_folder(tmp_path, 3),
                      photo_folder(tmp_path, 5, "gate"))  # fmt: skip
    report = json.loads((path.parent / REPORT).read_text())
    assert (report["calibration_photos"], report["gate_photos"]) == (3, 5)
    assert report["recipes"][0]["recipe"] == ("nncf-w7" if this_cpu().saturates else "nncf-w8")
    assert report["backend"] == "openvino"


def _loaded(settings: Settings) -> Any:
    from app.engine.factory import load_configured_model

    return load_configured_model(settings.own_model())

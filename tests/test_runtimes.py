"""ONNX Runtime and OpenVINO backends: export, artefacts, the start-up check, INT8 gating."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.engine import ImageRequest, InferenceEngine, StartupError, build_engine
from app.engine import factory as factory_module
from app.engine.errors import CheckFailedError, UngatedModelError
from app.engine.machine import Machine, fixed_rates
from app.engine.model import store as store_module
from app.engine.model.artifacts import REPORT, write_json
from app.engine.model.export import ONNX_FILE, export_onnx
from app.settings import Settings
from tests import images
from tests.conftest import COLOR_MODEL, make_settings, serve
from tests.models import ColorClassifier

JPEG = {"content-type": "image/jpeg"}
RUNTIMES = ["onnxruntime", "openvino"]


def runtime_settings(tmp_path: Path, backend: str, **overrides: Any) -> Settings:
    return make_settings(backend=backend, artifacts_dir=tmp_path / "artifacts", **overrides)


def artifact_dirs(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir()) if root.exists() else []


async def predictions(client: httpx.AsyncClient, pictures: list[bytes]) -> list[Any]:
    answers = []
    for data in pictures:
        response = await client.post("/predict?top_k=12", content=data, headers=JPEG)
        assert response.status_code == 200, response.text
        answers.append(response.json()["predictions"])
    return answers


@pytest.mark.parametrize("backend", RUNTIMES)
async def test_a_runtime_serves_what_the_torch_backend_serves(tmp_path: Path, backend: str) -> None:
    pictures = [images.jpeg(images.photo(200, 150, seed=seed)) for seed in range(6)]
    async with serve(make_settings()) as (_, client):
        expected = await predictions(client, pictures)
    async with serve(runtime_settings(tmp_path, backend)) as (_, client):
        got = await predictions(client, pictures)
        (model,) = (await client.get("/v1/models")).json()["models"]
    for mine, theirs in zip(got, expected, strict=True):
        assert [p["index"] for p in mine] == [p["index"] for p in theirs]
        for a, b in zip(mine, theirs, strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    assert model["backend"]["name"] == backend
    assert model["precision"] == "fp32"
    assert model["backend"]["artifact"].startswith(str(tmp_path))
    assert model["check"]["passed"] is True
    assert model["check"]["max_probability_difference"] < 1e-4


def test_artefacts_are_made_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = runtime_settings(tmp_path, "openvino")
    build_engine(settings.own_model())
    made = artifact_dirs(settings.artifacts_dir)
    assert len(made) == 2  # the ONNX export and the OpenVINO IR made from it
    assert all("-224-fp32-" in name for name in made)

    def no_export(*args: object) -> None:
        raise AssertionError("a finished artefact must be reused, not made again")

    monkeypatch.setattr(store_module, "export_onnx", no_export)
    monkeypatch.setattr(store_module, "convert_to_openvino", no_export)
    engine = build_engine(settings.own_model())
    assert engine.check is not None
    assert engine.check["passed"]
    assert artifact_dirs(settings.artifacts_dir) == made


def test_a_failed_export_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_crash(
        module: torch.nn.Module, shape: tuple[int, ...], path: Path, *_: Any
    ) -> None:
        path.write_bytes(b"half an ONNX file")
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(store_module, "export_onnx", half_then_crash)
    settings = runtime_settings(tmp_path, "onnxruntime")
    with pytest.raises(RuntimeError, match="exporter crashed"):
        build_engine(settings.own_model())
    assert artifact_dirs(settings.artifacts_dir) == []  # no partial artefact, no scratch


class Doubled(ColorClassifier):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_an_artefact_that_disagrees_with_eager_pytorch_stops_start_up(tmp_path: Path) -> None:
    settings = runtime_settings(tmp_path, "onnxruntime")
    build_engine(settings.own_model())
    (folder,) = settings.artifacts_dir.iterdir()
    export_onnx(Doubled(), (3, 224, 224), folder / ONNX_FILE)  # what a broken exporter makes
    with pytest.raises(CheckFailedError, match="disagrees with eager PyTorch"):
        build_engine(settings.own_model())


@pytest.mark.parametrize(("backend", "module"), [("onnxruntime", "onnxruntime"),
                                                  ("openvino", "openvino")])  # fmt: skip
def test_a_missing_runtime_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like
    settings = runtime_settings(tmp_path, backend)
    extra = "onnx" if backend == "onnxruntime" else "openvino"
    with pytest.raises(StartupError, match=rf"pip install 'batchserve\[{extra}\]'"):
        build_engine(settings.own_model())


def test_unsupported_precisions_are_refused(tmp_path: Path) -> None:
    settings = runtime_settings(tmp_path, "onnxruntime", precision="bf16")
    with pytest.raises(StartupError, match="serves fp32 or int8"):
        build_engine(settings.own_model())
    with pytest.raises(ValueError, match="PRECISION=int8 is served by"):
        make_settings(precision="int8")


def test_auto_serves_the_fastest_installed_backend_and_remembers_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings(_env_file=None).backend == "auto"  # the default
    # Rates made up and steady, so that one candidate wins beyond the noise (real ones may not).
    made_up = {"torch": 100.0, "onnxruntime": 300.0, "openvino": 200.0}
    machine = fixed_rates(lambda backend: made_up[backend.name])
    settings = runtime_settings(tmp_path, "auto", precision="auto")
    engine = build_engine(settings.own_model(), machine=machine)
    choice = engine.backend.choice
    assert choice is not None
    rates = choice["rates"]
    assert set(rates) == {"torch", "onnxruntime", "openvino"}
    assert engine.backend.name == choice["chosen"] == "onnxruntime"
    assert choice["rounds"]["openvino"] == [200.0] * 5  # every candidate, every round
    assert engine.backend.describe()["auto"]["chosen"] == engine.backend.name
    if engine.backend.name != "torch":
        assert engine.check is not None
        assert engine.check["passed"]  # checked against eager PyTorch like any runtime
    assert len(list((settings.artifacts_dir / "backend-choice").glob("*.json"))) == 1

    def measured(*args: object) -> float:
        raise AssertionError("measured again")

    # Nor PRECISION=auto's fp32 against bf16 (on a CPU with both): the choice kept which.
    never = Machine(native_bf16=False, rate=measured)
    again = build_engine(settings.own_model(), machine=never)  # a later start
    assert again.backend.name == engine.backend.name
    assert again.precision == engine.precision == choice["precision"]
    assert again.backend.choice is not None
    assert again.backend.choice["reused"]
    other = runtime_settings(tmp_path, "auto", max_batch_size=4)  # another warm-up batch
    with pytest.raises(AssertionError, match="measured again"):
        build_engine(other.own_model(), machine=never)
    # PRECISION=int8: only the INT8 runtimes compete, and none has a gated model here.
    int8 = runtime_settings(tmp_path, "auto", precision="int8")
    with pytest.raises(StartupError, match="no installed backend can serve this model in PRECI"):
        build_engine(int8.own_model(), machine=machine)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_precision_auto_offers_a_runtime_what_it_serves_here(native_bf16: bool) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    openvino = make_settings(backend="openvino", precision="auto")
    onnxruntime = make_settings(backend="onnxruntime", precision="auto")
    bf16 = ("fp32", "bf16") if native_bf16 else ("fp32",)
    precisions = factory_module.runtime_precisions
    assert precisions(openvino.own_model(), cpu, native_bf16) == bf16
    assert precisions(onnxruntime.own_model(), cpu, native_bf16) == ("fp32",)
    assert precisions(onnxruntime.own_model(), cuda, native_bf16) == ("fp32",)
    explicit = make_settings(backend="openvino", precision="int8")
    assert precisions(explicit.own_model(), cpu, native_bf16) == ("int8",)


def test_a_backend_choice_is_kept_apart_for_a_cpu_with_native_bf16(tmp_path: Path) -> None:
    from app.engine import choice as choice_module

    settings = runtime_settings(tmp_path, "auto", precision="auto")
    paths = set()
    for native in (True, False):
        paths.add(choice_module.decision_path(settings.own_model(), "digest", 8, [], native))
    assert len(paths) == 2  # bf16 candidates or none: a choice made without them is not reused


def test_openvino_serves_bf16_with_precision_auto_when_it_measures_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("openvino")
    from app.engine.device import cpu_supports_bf16

    if not cpu_supports_bf16():
        pytest.skip("this CPU has no native bf16 kernels: PRECISION=auto is fp32 here")
    rates = {"fp32": 100.0, "bf16": 200.0}
    machine = fixed_rates(lambda backend: rates[backend.precision], native_bf16=True)
    settings = runtime_settings(tmp_path, "openvino", precision="auto")
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "bf16"
    assert engine.backend.describe()["measured_images_per_second"] == rates
    assert engine.check is not None
    assert engine.check["passed"]  # at bf16's bounds
    rates["bf16"] = 105.0  # not the 1.1x that a less precise candidate must win by
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "fp32"


def test_auto_serves_the_simplest_of_candidates_within_the_noise_and_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    # OpenVINO's median is the highest, but it beats the others by less than its rounds vary.
    rounds = {
        "torch": iter([100.0, 130.0, 100.0, 130.0, 100.0]),
        "onnxruntime": iter([90.0] * 5),
        "openvino": iter([110.0, 140.0, 110.0] * 2),
    }
    machine = fixed_rates(lambda backend: next(rounds[backend.name]))
    settings = runtime_settings(tmp_path, "auto", precision="fp32")
    engine = build_engine(settings.own_model(), machine=machine)
    choice = engine.backend.choice
    assert choice is not None
    assert engine.backend.name == "torch"
    assert "torch, openvino measured within the noise" in choice["reason"]
    assert not (settings.artifacts_dir / "backend-choice").exists()  # measured again next time


def test_beyond_the_noise_means_a_margin_larger_than_the_rounds_vary() -> None:
    from app.engine.choice import beats, preference

    assert beats([110.0] * 4, [100.0] * 4)
    assert not beats([110.0, 95.0, 125.0], [100.0, 100.0, 100.0])  # 1.1 +- 0.15
    assert beats([115.0, 111.0, 119.0], [100.0, 100.0, 100.0])  # 1.15 +- 0.04
    assert not beats([100.0] * 3, [100.0] * 3)
    order, within = preference({"torch": [100.0] * 3, "openvino": [150.0] * 3})
    assert (order, within) == (["openvino", "torch"], [])
    order, within = preference({"torch": [100.0, 90.0, 110.0], "onnxruntime": [50.0] * 3,
                                "openvino": [108.0, 85.0, 112.0]})  # fmt: skip
    assert (order, within) == (["torch", "openvino", "onnxruntime"], ["torch", "openvino"])


def test_a_batch_that_takes_seconds_is_timed_in_fewer_runs_and_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large detector's start-up on a CPU: three rounds, one timed run after the warm-up."""
    from torch import nn

    from app.engine import choice
    from app.engine.backends import TorchBackend
    from app.engine.checks import precision

    made_up = {"fast": 400.0, "slow": 4.0}  # batches of 8: 0.02 s and 2 s
    machine = fixed_rates(lambda backend: made_up[backend.name])
    backends: dict[str, Any] = {"fast": _Named("fast"), "slow": _Named("slow")}
    rounds = choice.measure_in_rounds(backends, (3, 8, 8), 8, machine=machine)
    assert len(rounds["slow"]) == choice.LONG_ROUNDS < choice.ROUNDS
    made_up["slow"] = 40.0  # 0.2 s
    assert len(choice.measure_in_rounds(backends, (3, 8, 8), 8, machine=machine)["slow"]) == (
        choice.ROUNDS
    )

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.runs = 0

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            self.runs += 1
            return batch.mean((2, 3))

    monkeypatch.setattr(precision, "LONG_PASS_SECONDS", 0.0)  # every pass is long
    module = Counted()
    backend = TorchBackend(module, torch.device("cpu"), torch.float32, (3, 8, 8))
    module.runs = 0
    assert Machine(native_bf16=False).rate(backend, (3, 8, 8), 2, 0.0) > 0
    assert module.runs == 2  # the warm-up and one timed run
    monkeypatch.setattr(precision, "LONG_PASS_SECONDS", 60.0)
    module.runs = 0
    precision.images_per_second(backend, (3, 8, 8), 2, 0.0)
    assert module.runs == 4


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def test_an_unreadable_kept_decision_is_measured_again_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    made_up = {"torch": 100.0, "onnxruntime": 300.0, "openvino": 200.0}
    machine = fixed_rates(lambda backend: made_up[backend.name])
    settings = runtime_settings(tmp_path, "auto", precision="fp32")
    build_engine(settings.own_model(), machine=machine)
    (kept,) = (settings.artifacts_dir / "backend-choice").glob("*.json")
    kept.write_text(json.dumps({"chosen": "openvino", "precision": "fp32"}))  # no rates
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        engine = build_engine(settings.own_model(), machine=machine)
    assert engine.backend.name == "onnxruntime"  # measured again, not taken from the file
    assert "ignoring the unreadable backend choice" in caplog.text
    kept.write_text("[1, 2")
    assert build_engine(settings.own_model(), machine=machine).backend.name == "onnxruntime"


def test_auto_serves_the_fastest_candidate_that_passes_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    # Both runtimes' artefacts exist; then the ONNX model is replaced by a broken export.
    # (OpenVINO's IR was converted before, from the sound one.)
    openvino = runtime_settings(tmp_path, "openvino", precision="fp32")
    build_engine(openvino.own_model())
    (onnx_folder,) = [path for path in openvino.artifacts_dir.iterdir()
                      if "-fp32-onnx-" in path.name]  # fmt: skip
    export_onnx(Doubled(), (3, 224, 224), onnx_folder / ONNX_FILE)
    # ONNX Runtime measures fastest, OpenVINO next.
    rates = {"onnxruntime": 300.0, "openvino": 200.0, "torch": 100.0}
    machine = fixed_rates(lambda backend: rates[backend.name])
    settings = runtime_settings(tmp_path, "auto", precision="fp32")
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.backend.name == "openvino"
    assert engine.check is not None
    assert engine.check["passed"]
    choice = engine.backend.choice
    assert choice is not None
    assert list(choice["rejected"]) == ["onnxruntime"]
    assert "disagrees with eager PyTorch" in choice["rejected"]["onnxruntime"][0]
    again = build_engine(settings.own_model(), machine=machine)  # the kept decision
    assert again.backend.name == "openvino"


def test_onnxruntime_on_cuda_runs_the_precision_it_reports(tmp_path: Path) -> None:
    """fp32 never runs TensorRT in fp16; fp16 runs on TensorRT or not at all (the CUDA provider
    would run the fp32 export while the server reported fp16)."""
    pytest.importorskip("onnxruntime")
    from app.engine.backends.onnx_runtime import OnnxRuntimeBackend, providers

    cuda = torch.device("cuda")
    path = tmp_path / "model.onnx"
    fp32 = providers(cuda, path, "fp32")
    assert [p[0] if isinstance(p, tuple) else p for p in fp32] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider",
    ]  # fmt: skip
    assert fp32[0][1]["trt_fp16_enable"] == "False"
    fp16 = providers(cuda, path, "fp16")
    assert [p[0] if isinstance(p, tuple) else p for p in fp16] == [
        "TensorrtExecutionProvider", "CPUExecutionProvider",
    ]  # fmt: skip
    assert fp16[0][1]["trt_fp16_enable"] == "True"
    assert fp16[0][1]["trt_engine_cache_path"] != fp32[0][1]["trt_engine_cache_path"]
    # Here (no TensorRT) ONNX Runtime falls back to the CPU: fp16 must be refused, not faked.
    export_onnx(ColorClassifier(), (3, 224, 224), path)
    refused = pytest.raises(StartupError, match="PRECISION=fp16 with BACKEND=onnxruntime runs on")
    with pytest.warns(UserWarning, match="not in available provider names"), refused:
        OnnxRuntimeBackend(path, cuda, precision="fp16", threads=1, classes=12)


# -- INT8 ----------------------------------------------------------------------------------


def calibration_folder(tmp_path: Path, count: int = 10) -> Path:
    folder = tmp_path / "calibration"
    folder.mkdir()
    for seed in range(count):
        (folder / f"{seed}.jpg").write_bytes(images.jpeg(images.photo(240, 180, seed=seed)))
    return folder


@pytest.mark.parametrize("backend", RUNTIMES)
def test_int8_is_refused_without_a_passing_gate_and_served_with_one(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A model with convolutions: INT8 must run faster than fp32 to be served.
    conv = "tests.models:conv_color_classifier"
    settings = runtime_settings(tmp_path, backend, precision="int8", model=conv)
    with pytest.raises(UngatedModelError, match=r"python -m app\.quantize"):
        build_engine(settings.own_model())

    calibrated = runtime_settings(
        tmp_path, backend, precision="int8", model=conv,
        calibration_dir=calibration_folder(tmp_path),
    )  # fmt: skip
    engine = build_engine(calibrated.own_model())  # builds it, gates it
    assert engine.precision == "int8"
    artifact = Path(engine.backend.describe()["artifact"])
    report = json.loads((artifact.parent / REPORT).read_text())
    assert report["passed"], report
    assert report["backend"] == backend
    assert report["gate_images"] == 5 * 6  # the held-out half and five variants of each

    # Figures that fail the bounds: refused, naming the report; served only with the loud
    # override.
    write_json(artifact.parent / REPORT, {**report, "confident_top1_agreement": 0.5})
    with pytest.raises(UngatedModelError, match=re.escape(REPORT)):
        build_engine(settings.own_model())
    forced = runtime_settings(tmp_path, backend, precision="int8", model=conv,
                              allow_ungated_int8=True)  # fmt: skip
    with caplog.at_level(logging.CRITICAL, logger="batchserve"):
        build_engine(forced.own_model())
    assert "DID NOT PASS ITS ACCURACY GATE" in caplog.text
    shutil.rmtree(settings.artifacts_dir)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_onnxruntime_on_cuda_agrees_with_eager_pytorch(tmp_path: Path, precision: str) -> None:
    import onnxruntime

    settings = runtime_settings(tmp_path, "onnxruntime", device="cuda", precision=precision)
    has_tensorrt = "TensorrtExecutionProvider" in onnxruntime.get_available_providers()
    if precision == "fp16" and not has_tensorrt:  # refused rather than run in fp32
        with pytest.raises(StartupError, match="runs on its TensorRT provider"):
            build_engine(settings.own_model(), settings.own_model().batch_config("cuda"))
        return
    engine = build_engine(settings.own_model(), settings.own_model().batch_config("cuda"))
    assert engine.check is not None
    assert engine.check["passed"]
    expected = ("TensorrtExecutionProvider",) if precision == "fp16" else (
        "TensorrtExecutionProvider", "CUDAExecutionProvider")  # fmt: skip
    assert engine.backend.describe()["providers"][0] in expected


def run_tool(
    module: str, tmp_path: Path, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` as a user runs it, with the test model's settings."""
    environment = {
        **os.environ,
        "BATCHSERVE_MODEL": COLOR_MODEL,
        "BATCHSERVE_WEIGHTS": "none",
        "BATCHSERVE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
        "BATCHSERVE_LOG_LEVEL": "warning",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", module, *args], env=environment, capture_output=True, text=True,
        cwd=Path(__file__).parent.parent, timeout=300,
    )  # fmt: skip


def test_export_tool_writes_both_artefacts_that_start_up_then_reuses(tmp_path: Path) -> None:
    done = run_tool("app.export", tmp_path)
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.split()]
    assert [path.suffix for path in written] == [".onnx", ".xml"]
    assert all(path.is_file() for path in written)
    before = artifact_dirs(tmp_path / "artifacts")
    build_engine(runtime_settings(tmp_path, "openvino").own_model())
    assert artifact_dirs(tmp_path / "artifacts") == before  # served from what the tool wrote


def test_openvino_on_a_cpu_computes_with_one_stream_of_every_thread(tmp_path: Path) -> None:
    # Two batches in flight on a CPU: the second only gets ready ahead, so two streams would
    # leave half of the threads idle while one batch computes.
    settings = runtime_settings(tmp_path, "openvino", max_inflight_batches=2)
    engine = build_engine(settings.own_model())
    assert engine.max_inflight_batches == 2
    assert engine.backend.describe()["hint"] == "LATENCY"
    assert engine.backend.serialized


def torch_threads_in_a_batch(engine: InferenceEngine, starting: int) -> int:
    """torch's thread count during the forward pass of a batch run from a new thread whose
    own count is ``starting`` (as the batcher's threads may start)."""
    seen: list[int] = []
    forward = engine.backend.forward

    def counting(batch: torch.Tensor, sizes: Any = None) -> Any:
        seen.append(torch.get_num_threads())
        return forward(batch, sizes)

    engine.backend.forward = counting  # type: ignore[method-assign]
    image = engine.prepare(images.jpeg(images.photo(64, 48)))

    def batch_thread() -> None:
        torch.set_num_threads(starting)
        (outcome,) = engine.run_batch([ImageRequest(image, 1)])
        assert not isinstance(outcome, BaseException)

    thread = threading.Thread(target=batch_thread)
    thread.start()
    thread.join()
    (count,) = seen
    return count


@pytest.mark.parametrize("backend", ["torch", *RUNTIMES])
def test_torch_runs_on_one_thread_in_a_runtimes_batches_and_on_all_in_its_own(
    tmp_path: Path, backend: str
) -> None:
    # Beside a runtime, torch's spinning OpenMP team takes cores from the runtime's threads.
    before = torch.get_num_threads()
    try:
        settings = runtime_settings(tmp_path, backend, torch_threads=2)
        engine = build_engine(settings.own_model())
        if backend == "torch":
            assert torch_threads_in_a_batch(engine, starting=1) == 2
        else:
            assert torch_threads_in_a_batch(engine, starting=2) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "command", [["app.export"], ["app.quantize", "--calibration", "."]], ids=lambda c: c[0]
)
def test_tools_refuse_invalid_settings_in_one_line(tmp_path: Path, command: list[str]) -> None:
    done = run_tool(command[0], tmp_path, *command[1:], BATCHSERVE_MAX_BATCH_SIZE="0")
    assert done.returncode == 2
    assert done.stderr.startswith("batchserve: invalid settings:")
    assert "Traceback" not in done.stderr
    assert "BATCHSERVE_MAX_BATCH_SIZE" in done.stderr


def test_quantize_tool_needs_a_runtime_backend(tmp_path: Path) -> None:
    done = run_tool("app.quantize", tmp_path, "--calibration", str(tmp_path))
    assert done.returncode == 2
    assert "BATCHSERVE_BACKEND=onnxruntime or openvino" in done.stderr

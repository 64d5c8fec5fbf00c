"""Model loading through the real path, labels, precision choice, and the batched engine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision.models import MobileNet_V3_Small_Weights, get_model

from app.engine import (
    Backend,
    BatchReport,
    EngineObserver,
    ImageRequest,
    InferenceEngine,
    ModelLoadError,
    Prediction,
    build_engine,
    load_model,
)
from app.engine.checks.gate import CHECK_BOUNDS, Bounds
from app.engine.device import DeviceError, precision_candidates, resolve_device
from app.engine.errors import CheckFailedError
from app.engine.machine import fixed_rates
from app.engine.model.compile import optimize, resolve_compile
from app.engine.pipeline.slot import BatchSlot
from app.settings import Settings
from preprocessing import ImageFormat, ImageHeader, PreparedImage, TransformConfig, prepare
from tests import images
from tests.checks import assert_same_prediction
from tests.conftest import COLOR_MODEL, make_settings
from tests.engines import torch_engine
from tests.models import TracesDifferently, Untraceable

SMALL = "mobilenet_v3_small"


def write_labels(path: Path, count: int) -> Path:
    path.write_text("".join(f"class {index}\n" for index in range(count)) + "\n\n")
    return path


def probe(module: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        return module.eval()(torch.randn(2, 3, 224, 224, generator=generator))  # type: ignore[no-any-return]


# -- loading -------------------------------------------------------------------------------


def test_state_dict_from_a_path_loads_through_the_real_path(tmp_path: Path) -> None:
    trained = get_model(SMALL, weights=None, num_classes=10)
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    labels = write_labels(tmp_path / "labels.txt", 10)
    loaded = load_model(SMALL, str(tmp_path / "model.pt"), labels)
    assert loaded.weights == str(tmp_path / "model.pt")
    assert loaded.labels == tuple(f"class {index}" for index in range(10))
    assert torch.equal(probe(loaded.module), probe(trained))


@pytest.mark.parametrize("wrap", ["state_dict", "model_state_dict", "module-prefix", "compiled"])
def test_checkpoint_dicts_and_wrapper_prefixes(tmp_path: Path, wrap: str) -> None:
    trained = get_model(SMALL, weights=None, num_classes=4)
    state = trained.state_dict()
    payload: object
    if wrap == "module-prefix":
        payload = {f"module.{key}": value for key, value in state.items()}
    elif wrap == "compiled":
        payload = {"state_dict": {f"_orig_mod.{key}": value for key, value in state.items()}}
    else:
        payload = {wrap: state, "epoch": 7, "optimizer": {"lr": torch.tensor(0.1)}}
    torch.save(payload, tmp_path / "checkpoint.pth")
    loaded = load_model(
        SMALL, str(tmp_path / "checkpoint.pth"), write_labels(tmp_path / "labels.txt", 4)
    )
    assert torch.equal(probe(loaded.module), probe(trained))


def test_checkpoint_with_the_wrong_shapes_fails_with_a_clear_message(tmp_path: Path) -> None:
    torch.save(get_model(SMALL, weights=None, num_classes=10).state_dict(), tmp_path / "m.pt")
    with pytest.raises(ModelLoadError) as raised:
        load_model(SMALL, str(tmp_path / "m.pt"))  # no LABELS: the model gets 1000 classes
    message = str(raised.value)
    assert "shape mismatch" in message
    assert "(10, 1024) vs model (1000, 1024)" in message
    assert "BATCHSERVE_LABELS" in message


def test_checkpoint_of_another_architecture_fails_with_a_clear_message(tmp_path: Path) -> None:
    torch.save(get_model("resnet18", weights=None).state_dict(), tmp_path / "r.pt")
    with pytest.raises(ModelLoadError, match=r"missing keys.*unexpected keys"):
        load_model(SMALL, str(tmp_path / "r.pt"))


def test_files_that_are_not_state_dicts(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(SMALL, str(tmp_path / "notes.txt"))
    torch.save({"epoch": 3}, tmp_path / "empty.pt")
    with pytest.raises(ModelLoadError, match="holds no state_dict"):
        load_model(SMALL, str(tmp_path / "empty.pt"))
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(SMALL, str(tmp_path / "missing.pt"))


def test_unknown_model_names_suggest_close_ones() -> None:
    with pytest.raises(ModelLoadError, match="did you mean resnet50"):
        load_model("resnet5O", "none")


def test_random_weights_on_purpose_use_the_imagenet_labels_and_preset() -> None:
    loaded = load_model(SMALL, "none")
    assert loaded.weights == "random"
    assert len(loaded.labels) == 1000
    assert loaded.labels[1] == "goldfish"
    assert (loaded.transform.crop_size, loaded.transform.resize_size) == (224, 256)


def test_image_size_keeps_the_preset_ratio() -> None:
    loaded = load_model("resnet50", "none", image_size=160)
    # resnet50's DEFAULT weights evaluate at resize 232 / crop 224.
    assert (loaded.transform.crop_size, loaded.transform.resize_size) == (160, 166)


def test_label_count_must_match_the_outputs(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="3 labels but the model has 12 outputs"):
        load_model(COLOR_MODEL, "none", write_labels(tmp_path / "labels.txt", 3))
    loaded = load_model(COLOR_MODEL, "none", write_labels(tmp_path / "labels.txt", 12))
    assert loaded.labels[11] == "class 11"


def test_auto_without_cache_or_network_falls_back_to_random_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(url: str, *args: object, **kwargs: object) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        loaded = load_model(SMALL, "auto")
    assert loaded.weights == "random"
    assert "RANDOM weights" in caplog.text
    assert "network is unreachable" in caplog.text


def test_pretrained_without_cache_or_network_stops_instead_of_serving_random_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(url: str, *args: object, **kwargs: object) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    assert Settings(_env_file=None).weights == "pretrained"  # the default
    with pytest.raises(ModelLoadError, match="not in the torch hub cache") as raised:
        load_model(SMALL, "pretrained")
    assert "network is unreachable" in str(raised.value)
    assert "WEIGHTS=auto serves random weights" in str(raised.value)


def test_auto_uses_weights_found_in_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = MobileNet_V3_Small_Weights.DEFAULT
    cached = tmp_path / "hub" / "checkpoints" / os.path.basename(weights.url)
    cached.parent.mkdir(parents=True)
    reference = get_model(SMALL, weights=None)
    torch.save(reference.state_dict(), cached)

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not download a cached file")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    loaded = load_model(SMALL, "auto")
    assert loaded.weights == "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    assert torch.equal(probe(loaded.module), probe(reference))


# -- device and precision ------------------------------------------------------------------


def test_precision_choice() -> None:
    cpu = torch.device("cpu")
    assert precision_candidates("auto", cpu, True) == (torch.float32, torch.bfloat16)
    assert precision_candidates("auto", cpu, False) == (torch.float32,)
    assert precision_candidates("fp16", cpu, True) == (torch.float16,)
    assert precision_candidates("auto", torch.device("cuda"), True) == (torch.float16,)


def test_auto_precision_serves_bf16_only_where_it_is_measured_faster() -> None:
    """Some CPUs report native bf16 and still run it slower than fp32: measure, then choose."""
    settings = make_settings(precision="auto", compile="none")
    for bf16_rate, chosen in ((100.0, "fp32"), (105.0, "fp32"), (200.0, "bf16")):
        rates = {torch.float32: 100.0, torch.bfloat16: bf16_rate}

        def rate(backend: Backend, rates: dict[torch.dtype, float] = rates) -> float:
            return rates[backend.input_dtype]

        machine = fixed_rates(rate, native_bf16=True)
        engine = build_engine(settings.own_model(), machine=machine)
        assert engine.precision == chosen
        assert engine.backend.describe()["measured_images_per_second"] == {
            "fp32": 100.0, "bf16": bf16_rate,
        }  # fmt: skip
        (result,) = engine.run_batch([request(1)])
        assert not isinstance(result, BaseException)


def test_auto_precision_serves_fp32_when_bf16_fails_its_start_up_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 measured faster is served only when it agrees with eager fp32 within bf16's
    bounds, as a runtime's bf16 must."""
    rates = {torch.float32: 100.0, torch.bfloat16: 200.0}
    machine = fixed_rates(lambda backend: rates[backend.input_dtype], native_bf16=True)
    settings = make_settings(precision="auto", compile="none")
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "bf16"
    assert engine.check is not None
    assert engine.check["passed"]
    assert engine.check["against"] == "eager PyTorch fp32 on the warm-up images"

    monkeypatch.setitem(
        CHECK_BOUNDS, "bf16", Bounds(max_probability_difference=0.0, min_top1_agreement=1.0)
    )
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "fp32"
    assert engine.check is None  # eager fp32 is the reference itself
    (failure,) = engine.backend.describe()["rejected_precisions"]["bf16"]
    assert "This model loses too much in bf16: serve it in fp32" in failure
    (result,) = engine.run_batch([request(1)])
    assert not isinstance(result, BaseException)


@pytest.mark.parametrize(
    ("model", "task", "figure"),
    [("tests.models:conv_grid_detector", "detect", "box_recall"),
     ("tests.models:conv_segmenter", "segment", "min_pixel_agreement"),
     ("tests.models:conv_encoder", "embed", "min_cosine")],
)  # fmt: skip
def test_auto_precision_weighs_bf16_for_every_task_checked_in_its_own_terms(
    model: str, task: str, figure: str
) -> None:
    rates = {torch.float32: 100.0, torch.bfloat16: 200.0}
    machine = fixed_rates(lambda backend: rates[backend.input_dtype], native_bf16=True)
    settings = make_settings(model=model, task=task, precision="auto", compile="none")
    engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "bf16"
    assert engine.check is not None
    assert engine.check["passed"]
    assert figure in engine.check  # judged in the task's terms, not as probabilities


def test_auto_precision_serves_fp32_where_the_model_does_not_run_in_bf16(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rates = {torch.float32: 100.0, torch.bfloat16: 200.0}
    machine = fixed_rates(lambda backend: rates[backend.input_dtype], native_bf16=True)
    settings = make_settings(model="tests.models:float_probe_encoder", task="embed",
                             precision="auto", compile="none")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="batchserve"):
        engine = build_engine(settings.own_model(), machine=machine)
    assert engine.precision == "fp32"
    (why,) = engine.backend.describe()["rejected_precisions"]["bf16"]
    assert why.startswith("does not run this model:")
    assert "bf16 does not run this model" in caplog.text
    (result,) = engine.run_batch([request(1)])
    assert not isinstance(result, BaseException)


def test_bf16_asked_for_by_name_fails_the_start_when_it_fails_its_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CHECK_BOUNDS, "bf16", Bounds(max_probability_difference=0.0))
    settings = make_settings(precision="bf16", compile="none")
    with pytest.raises(CheckFailedError, match="loses too much in bf16"):
        build_engine(settings.own_model())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_requested_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda:0")


# -- the engine ----------------------------------------------------------------------------


def make_engine(precision: torch.dtype = torch.float32) -> InferenceEngine:
    return torch_engine(dtype=precision)


def request(seed: int, top_k: int = 3, transform: TransformConfig | None = None) -> ImageRequest:
    data = images.jpeg(images.photo(160, 120, seed=seed))
    return ImageRequest(prepare(data, transform or TransformConfig()), top_k)


def test_run_batch_returns_sorted_top_k_per_request() -> None:
    engine = make_engine()
    results = engine.run_batch([request(1, top_k=3), request(2, top_k=5)])
    assert [len(result.classes) for result in results] == [3, 5]  # type: ignore[union-attr]
    for result in results:
        assert not isinstance(result, BaseException)
        scores = [entry["score"] for entry in result.classes]
        assert scores == sorted(scores, reverse=True)
        assert 0 < sum(scores) <= 1.0 + 1e-6
        assert result.batch_size == 2
        assert set(result.timings) == {"collate", "forward", "postprocess"}


def test_one_bad_item_does_not_fail_the_batch() -> None:
    engine = make_engine()
    # Neither pixels nor bytes: nothing to batch.
    header = ImageHeader(ImageFormat.JPEG, 9, 9)
    broken = ImageRequest(PreparedImage(header, engine.transform.placement(9, 9)), top_k=1)
    results = engine.run_batch([request(1), broken, request(2)])
    assert isinstance(results[1], ValueError)
    assert not isinstance(results[0], BaseException)
    assert not isinstance(results[2], BaseException)
    assert results[0].batch_size == 2


def test_batched_results_equal_single_results() -> None:
    engine = make_engine()
    batch = [request(seed) for seed in range(6)]
    together = engine.run_batch(batch)
    for item, joint in zip(batch, together, strict=True):
        (alone,) = engine.run_batch([item])
        assert_same_prediction(joint, alone)


def test_bf16_agrees_with_fp32_on_the_top_class() -> None:
    fp32, bf16 = make_engine(torch.float32), make_engine(torch.bfloat16)
    batch = [request(seed) for seed in range(8)]
    for a, b in zip(fp32.run_batch(batch), bf16.run_batch(batch), strict=True):
        assert not isinstance(a, BaseException)
        assert not isinstance(b, BaseException)
        assert a.classes[0]["index"] == b.classes[0]["index"]
        assert a.classes[0]["score"] == pytest.approx(b.classes[0]["score"], abs=0.05)


def test_warmup_runs_every_bucket() -> None:
    engine = make_engine()
    timings = engine.warmup((1, 2, 4, 8))
    assert sorted(timings) == [1, 2, 4, 8]
    assert all(seconds > 0 for seconds in timings.values())


# -- compilation ---------------------------------------------------------------------------


def probe_batch() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchscript_gives_the_eager_answers(dtype: torch.dtype) -> None:
    model = get_model(SMALL, weights=None).eval().to(dtype)
    batch = probe_batch().to(dtype)
    compiled, mode = optimize(model, "torchscript", batch)
    assert mode == "torchscript"
    assert isinstance(compiled, torch.jit.ScriptModule)
    other = torch.randn(3, 3, 64, 64).to(dtype)  # another batch size works too
    with torch.inference_mode():
        expected, got = model(other).float(), compiled(other).float()
    assert (got - expected).abs().max() <= 0.06 * expected.abs().max()


def test_a_traced_model_is_kept_and_loaded_again_rather_than_traced_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing leaves types in TorchScript's global compilation unit for good (with frozen
    weights, about the model's size): a model built again, as a reload does, must come from
    the kept artefact."""
    model = get_model(SMALL, weights=None).eval()
    batch = probe_batch()
    artifact = tmp_path / "model.pt"
    first, mode = optimize(model, "torchscript", batch, artifact)
    assert mode == "torchscript"
    assert artifact.is_file()

    def no_tracing(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced again")

    monkeypatch.setattr(torch.jit, "trace", no_tracing)
    again, mode = optimize(model, "torchscript", batch, artifact)
    assert mode == "torchscript"
    with torch.inference_mode():
        assert torch.allclose(first(batch), again(batch))
    # An artefact that computes something else (other code, same weights) is made again.
    monkeypatch.undo()
    other = get_model(SMALL, weights=None).eval()
    _, mode = optimize(other, "torchscript", batch, artifact)
    assert mode == "torchscript"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated, and works
        loaded = torch.jit.load(str(artifact))  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        assert torch.allclose(loaded(batch), other(batch), atol=1e-3)


def test_untraceable_or_diverging_models_are_served_eagerly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for model in (Untraceable(), TracesDifferently()):
        with caplog.at_level(logging.WARNING, logger="batchserve"):
            served, mode = optimize(model.eval(), "torchscript", probe_batch())
        assert served is model
        assert mode == "none"
    assert "cannot be traced" in caplog.text
    assert "differs from the eager one" in caplog.text


def test_compile_auto_choice() -> None:
    assert resolve_compile("auto", torch.device("cpu")) == "torchscript"
    assert resolve_compile("auto", torch.device("cuda")) == "none"
    assert resolve_compile("inductor", torch.device("cpu")) == "inductor"


def test_engine_reports_the_compile_mode_it_serves_with() -> None:
    engine = torch_engine(compile_mode="torchscript")
    assert engine.backend.variant == "torchscript"
    assert engine.backend.describe()["compile"] == "torchscript"
    (result,) = engine.run_batch([request(1)])
    assert not isinstance(result, BaseException)


@pytest.mark.slow
def test_inductor_compiles_and_pads_to_buckets() -> None:
    engine = torch_engine(max_batch_size=4, buckets=(2, 4), compile_mode="inductor")
    assert engine.backend.variant == "inductor"
    assert engine.pads_to_buckets
    eager = make_engine()
    batch = [request(seed) for seed in range(3)]  # padded to the bucket of 4
    for a, b in zip(engine.run_batch(batch), eager.run_batch(batch), strict=True):
        assert_same_prediction(a, b, tolerance=1e-4)


def test_random_weights_are_the_same_in_every_engine() -> None:
    first, second = load_model(SMALL, "none"), load_model(SMALL, "none")
    assert torch.equal(probe(first.module), probe(second.module))


# -- the engine's seams: slots, readback, observer -----------------------------------------


class RecordingObserver(EngineObserver):
    def __init__(self) -> None:
        self.reports: list[BatchReport] = []

    def on_batch(self, report: BatchReport) -> None:
        self.reports.append(report)


def test_each_batch_is_reported_to_the_observer() -> None:
    observer = RecordingObserver()
    engine = torch_engine(observer=observer)
    engine.warmup((1, 2))
    assert observer.reports == []  # warm-up batches are not traffic
    # Neither pixels nor bytes: nothing to batch.
    header = ImageHeader(ImageFormat.JPEG, 9, 9)
    broken = ImageRequest(PreparedImage(header, engine.transform.placement(9, 9)), top_k=1)
    engine.run_batch([request(1), broken, request(2)])
    (report,) = observer.reports
    assert (report.rows, report.padded_rows) == (2, 2)
    assert set(report.stages) == {"collate", "forward", "postprocess"}
    assert report.busy_s > 0
    assert report.preprocess_s > 0
    assert report.forward_queued_at <= report.completed_at


def test_results_are_read_back_into_contiguous_views_of_the_slot() -> None:
    slot = BatchSlot(
        rows=4, input_shape=(3, 8, 8), input_dtype=torch.float32, channels_last=True,
        classes=10, device=torch.device("cpu"), stream=None,
    )  # fmt: skip
    scores, indices = slot.readback(3, 5)
    assert scores.shape == indices.shape == (3, 5)
    assert scores.is_contiguous()
    assert indices.is_contiguous()
    assert scores.data_ptr() == slot.scores.data_ptr()
    assert indices.data_ptr() == slot.indices.data_ptr()


def test_a_slot_keeps_the_tensors_of_its_batch_until_the_batch_is_done() -> None:
    engine = torch_engine(decode_on_device=True, max_inflight_batches=1)
    (slot,) = engine.slots
    held_during_forward: list[int] = []
    forward = engine.backend.forward

    def spying(batch: torch.Tensor, sizes: Any = None) -> Any:
        held_during_forward.append(slot.held)
        return forward(batch, sizes)

    engine.backend.forward = spying  # type: ignore[method-assign]
    pictures = [images.jpeg(images.photo(200, 150, seed=seed)) for seed in range(3)]
    results = engine.run_batch([ImageRequest(engine.prepare(data), 3) for data in pictures])
    assert all(not isinstance(result, BaseException) for result in results)
    assert held_during_forward == [6]  # each image's decoded tensor and its crop
    assert slot.held == 0  # dropped once the batch was done, not before


def test_a_failed_batch_lets_its_device_work_end_before_freeing_its_slot() -> None:
    engine = torch_engine(max_inflight_batches=1)
    settled: list[object] = []
    engine._streams.settle = settled.append  # type: ignore[method-assign,assignment]

    def failing(batch: torch.Tensor, sizes: Any = None) -> torch.Tensor:
        raise RuntimeError("kernel failed")

    engine.backend.forward = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="kernel failed"):
        engine.run_batch([request(1)])
    assert settled == [None]  # the slot's stream (none on a CPU) and the compute stream
    assert engine._slots.available == 1
    assert engine.slots[0].held == 0


def test_padding_only_where_the_backend_needs_fixed_shapes() -> None:
    assert not torch_engine().pads_to_buckets
    # Graphs are captured on CUDA only: asked for on a CPU, nothing is padded.
    assert not torch_engine(cuda_graphs=True).pads_to_buckets


def test_the_engine_imports_no_prometheus_code() -> None:
    code = "import sys, app.engine; print(sorted(m for m in sys.modules if 'prometheus' in m))"
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_build_engine_sets_the_thread_budget() -> None:
    before = torch.get_num_threads()
    try:
        settings = make_settings(torch_threads=1)
        build_engine(settings.own_model())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_dense_answers_come_as_one_array_not_a_dict_per_class() -> None:
    engine = torch_engine()
    pictures = [images.jpeg(images.photo(200, 150, seed=seed)) for seed in range(3)]
    everything = engine.run_batch(
        [ImageRequest(engine.prepare(data), engine.num_classes) for data in pictures]
    )
    asked = [ImageRequest(engine.prepare(pictures[0]), 2, dense=True),
             ImageRequest(engine.prepare(pictures[1]), 2),
             ImageRequest(engine.prepare(pictures[2]), 1, dense=True)]  # fmt: skip
    answers = engine.run_batch(asked)
    for request, answer, full in zip(asked, answers, everything, strict=True):
        assert isinstance(answer, Prediction)
        assert isinstance(full, Prediction)
        assert len(answer.classes) == request.top_k  # ranked as asked, never all the classes
        if not request.dense:
            assert answer.probabilities is None
            continue
        assert answer.probabilities is not None
        assert answer.probabilities.shape == (engine.num_classes,)
        for entry in full.classes:
            assert answer.probabilities[entry["index"]] == pytest.approx(entry["score"], abs=1e-6)


def test_shared_canvases_are_refused_for_a_model_whose_canvas_is_fixed(tmp_path: Path) -> None:
    from app.engine.factory import load_configured_model

    settings = make_settings(model=SMALL, weights="none", artifacts_dir=tmp_path,
                             canvas_buckets="224x320")  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"CANVAS_BUCKETS: .*FIT=center-crop"):
        load_configured_model(settings.own_model())

"""Build the engine the config describe: model, device, backend, precision, artefacts.

A little over 300 lines: it is the one place where the choices of a start meet (device,
precision candidates, backend, INT8 gate, start-up check), each made in a module of its own.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from app.engine.backends import Backend, TorchBackend, open_runtime
from app.engine.checks.precision import fastest
from app.engine.checks.startup_check import checked_against_eager, engine_check, is_checked
from app.engine.choice import choose_backend
from app.engine.device import (
    DTYPES,
    NAMES,
    precision_candidates,
    resolve_decode_device,
    resolve_device,
)
from app.engine.engine import InferenceEngine
from app.engine.errors import CheckFailedError, StartupError
from app.engine.int8.int8_gated import gated_int8, int8_ready
from app.engine.machine import Machine
from app.engine.model.cards import StaleCardError, load_described
from app.engine.model.compile import kept, resolve_compile
from app.engine.model.loading import LoadedModel, ModelLoadError, load_model, loaded_digest
from app.engine.model.store import (
    ensure_box_head,
    ensure_onnx,
    ensure_openvino,
    exportable,
    input_shape,
    runtime_decode,
    runtime_parts,
    torchscript_artifact,
)
from app.engine.observer import EngineObserver
from app.engine.sharding import shard
from app.engine.tasks import server_nms
from app.model_config import ModelConfig
from app.startup import Phases
from batching import BatchConfig
from preprocessing import ImageLimits

logger = logging.getLogger("batchserve")


def load_configured_model(config: ModelConfig, *, use_card: bool = True) -> LoadedModel:
    """The model the config name, with their weights, labels and input sizes: from its kept
    card when there is one (the module is then built only if something needs it)."""
    loaded = load_described(config, lambda: load_model(
        config.model, config.weights, config.labels, config.image_size,
        config.resize_size, config.task, config.fit,
    ), use_card=use_card)  # fmt: skip
    if config.canvas_buckets:
        if loaded.transform.buckets:  # the model's own: an export of one fixed shape
            raise ModelLoadError(
                f"CANVAS_BUCKETS: {config.model} takes only its own canvas "
                f"{loaded.transform.buckets[0][0]}x{loaded.transform.buckets[0][1]}"
            )
        # A serving choice, not the model's: kept out of its card.
        try:
            loaded.transform = replace(loaded.transform, buckets=config.canvas_buckets)
        except ValueError as exc:
            raise ModelLoadError(f"CANVAS_BUCKETS: {exc}") from exc
    return loaded


def build_engine(
    config: ModelConfig,
    batching: BatchConfig | None = None,
    observer: EngineObserver | None = None,
    *,
    device_lock: threading.Lock | None = None,
    phases: Phases | None = None,
    machine: Machine | None = None,
) -> InferenceEngine:
    """Load the configured model onto the configured device and backend, in its precision.

    ``batching`` is the batcher's configuration (by default ``config.batch_config`` for the
    device): the engine sizes its slots and batch buckets from it. A backend other than
    PyTorch serves from an exported artefact (made here when missing) and only after it
    agrees with eager PyTorch.
    ``device_lock``, shared by the engines of one device, keeps their forward passes from
    running at once. ``phases`` gets the time of each start-up phase. ``machine`` answers
    what precisions and backends are measured against (by default this machine, timed).
    """
    device = resolve_device(config.device, config.worker_index)
    build = _Build(device, batching or config.batch_config(device.type), phases or Phases(),
                   machine or Machine.here())  # fmt: skip
    phases = build.phases
    torch.set_num_threads(config.threads)
    with phases.phase("weights"):
        loaded = load_configured_model(config)
    try:
        engine: InferenceEngine | None = _engine_for(loaded, config, build, observer, device_lock)
        # Its checkpoint was hashed while the runtime compiled; or the module was built from
        # it (a detector's always is) and gave other weights than the card said.
        stale = loaded.stale()
    except StaleCardError:
        engine, stale = None, True
    if stale:
        logger.warning(
            "%s: the checkpoint %s holds other weights than its model card says (same size and "
            "modification time, other contents): building from the checkpoint",
            loaded.name, config.weights,
        )  # fmt: skip
        del engine
        with phases.phase("weights"):
            loaded = load_configured_model(config, use_card=False)
        engine = _engine_for(loaded, config, build, observer, device_lock)
    assert engine is not None
    return engine


@dataclass
class _Build:
    """What every step of one engine's build shares: where it runs, how it batches, where its
    phases' times go, the machine it measures on, and the candidates' start-up check."""

    device: torch.device
    batching: BatchConfig
    phases: Phases
    machine: Machine
    failures_of: Callable[[Backend], list[str]] | None = None

    @property
    def rows(self) -> int:
        """The batch a candidate's forward pass is timed at."""
        return min(8, self.batching.max_batch_size)


def _engine_for(
    loaded: LoadedModel,
    config: ModelConfig,
    build: _Build,
    observer: EngineObserver | None,
    device_lock: threading.Lock | None,
) -> InferenceEngine:
    """The engine of ``loaded`` on the configured backend and precision."""
    device, batching, phases = build.device, build.batching, build.phases
    limits = ImageLimits(
        max_pixels=config.max_image_pixels, resize_size=loaded.transform.resize_size,
        min_side=config.min_image_size,
    )  # fmt: skip

    def engine_of(backend: Backend) -> InferenceEngine:
        return InferenceEngine(
            loaded, backend, limits=limits, observer=observer,
            max_batch_size=batching.max_batch_size, buckets=batching.batch_buckets,
            max_inflight_batches=batching.max_inflight_batches,
            decode_on_device=resolve_decode_device(config.decode_device, device),
            device_lock=device_lock, torch_threads=torch_threads_in_batches(backend, config),
            nms_iou=server_nms(loaded.task, config.model, config.nms_iou),
            embed_normalize=config.embed_normalize,
        )  # fmt: skip

    # Candidates (of a precision or a backend) whose start-up check passed, and its report.
    checks: weakref.WeakKeyDictionary[Backend, dict[str, Any]] = weakref.WeakKeyDictionary()

    def failures_of(candidate: Backend) -> list[str]:
        """A candidate against its start-up check: what it fails (nothing, if it has none)."""
        if candidate in checks or not is_checked(candidate):
            return []
        try:
            checks[candidate] = engine_check(engine_of(candidate), loaded, device, phases)
        except CheckFailedError as exc:
            return [str(exc)]
        return []

    build.failures_of = failures_of
    if loaded.task != "classify":
        _check_task_support(config, loaded.task, device)
    if config.backend == "auto" and not _exportable(loaded):
        backend = _build_backend(config.with_backend("torch"), loaded, build)
        reason = ("a TorchScript export: PyTorch alone" if not exportable(loaded)
                  else "a list of boxes per image: PyTorch alone")  # fmt: skip
        backend.choice = {"chosen": "torch", "precision": backend.precision,
                          "reason": reason}  # fmt: skip
    elif config.backend == "auto":
        spent_before = _spent_elsewhere(phases)
        choosing = time.perf_counter()
        backend, choice = choose_backend(
            config, device, loaded_digest(loaded), input_shape(loaded), build.rows,
            lambda name, precision: _build_backend(
                config.with_backend(name, precision), loaded, build, own_copy=True
            ),
            lambda name: int8_ready(config.with_backend(name, "int8"), loaded),
            failures_of, device_lock, build.machine,
        )  # fmt: skip
        # Measuring (and building the candidates that lost) is the choice's own time.
        phases.add("choice", time.perf_counter() - choosing
                   - (_spent_elsewhere(phases) - spent_before))  # fmt: skip
        backend.choice = choice
        config = config.with_backend(backend.name, choice["precision"])
    else:
        backend = _build_backend(config, loaded, build)
    engine = engine_of(backend)
    if is_checked(backend):
        engine.check = checks.get(backend) or engine_check(engine, loaded, device, phases)
    with phases.phase("choice"):  # SHARDS=auto's measuring, when it measures
        served = shard(backend, config, model_digest=loaded_digest(loaded),
                       input_shape=input_shape(loaded), rows=build.rows,
                       device_lock=device_lock, machine=build.machine)  # fmt: skip
    if served is not backend:  # the check stands: the same artefact, run in parts
        checked, engine = engine.check, engine_of(served)
        engine.check = checked
    return engine


def torch_threads_in_batches(backend: Backend, config: ModelConfig) -> int:
    """How many threads torch uses in a batch: every one the forward pass may use where torch
    runs it (or a GPU does) or computes most of it (a two-stage detector's proposals and
    heads, beside the runtime that ran its backbone), one where a runtime on the CPU does.

    With a runtime, torch only normalises the batch and takes its top classes. Split over
    torch's OpenMP team, each of those steps leaves the team's threads spinning for their
    next job while the runtime's own threads start the forward pass on the same cores: on two
    cores, resnet18's batches in OpenVINO INT8 ran at 0.72x its forward pass that way, at
    0.87x with torch on one thread, and 1.15x as many images/s with decoding beside them
    (``benchmarks/studies/torch_threads/``).
    """
    if backend.name == "torch" or backend.device.type != "cpu":
        return config.threads
    if getattr(backend.decode, "torch_heavy", False):  # a two-stage detector's heads
        return config.threads
    return 1


def _spent_elsewhere(phases: Phases) -> float:
    """What a choice's candidates spent in phases of their own (building them, checking them)."""
    return sum(phases.seconds.get(name, 0.0) for name in ("artefacts", "compile", "check"))


def _build_backend(
    config: ModelConfig, loaded: LoadedModel, build: _Build, *, own_copy: bool = False
) -> Backend:
    if config.backend == "torch":
        # Its own copy when other backends may be built from the same module after it.
        return _torch_backend(config, loaded.copied() if own_copy else loaded, build)
    return _runtime_backend(config, loaded, build)


def _exportable(loaded: LoadedModel) -> bool:
    """Whether a runtime can serve the model (every one but a detector answering a list of
    boxes per image, and a TorchScript export)."""
    if not exportable(loaded):
        return False  # a TorchScript export (of a YOLO model): PyTorch alone runs it
    if loaded.task != "detect":
        return True
    try:
        runtime_parts(loaded)
    except StartupError:
        return False
    return True


def _check_task_support(config: ModelConfig, task: str, device: torch.device) -> None:
    """The precisions a task other than classification is served in on a CPU: fp32, bf16
    checked in the task's terms, or INT8 behind its task's gate (a detector's on a runtime,
    where its graph exports: ``runtime_parts``)."""
    served = ("auto", "fp32", "bf16", "int8")
    if device.type == "cpu" and config.precision not in served:
        raise StartupError(
            f"TASK={task} is served in {', '.join(served[1:-1])} or {served[-1]} on a CPU, "
            f"not PRECISION={config.precision}"
        )


def _torch_backend(config: ModelConfig, loaded: LoadedModel, build: _Build) -> Backend:
    device = build.device
    native_bf16 = build.machine.native_bf16
    candidates = precision_candidates(config.precision, device, native_bf16)
    shape = input_shape(loaded)
    # A detector's outputs have data-dependent sizes, and a model whose input follows each
    # image's size has one graph per size: traced or captured, either would be wrong.
    fixed = loaded.task != "detect" and loaded.transform.fit.fixed_canvas
    mode = resolve_compile(config.compile, device) if fixed else "none"
    graphs = config.cuda_graphs and fixed

    def candidate(precision: str) -> Backend:
        dtype = DTYPES[precision]
        artifact = (torchscript_artifact(config.artifacts_dir, loaded, dtype, device)
                    if mode == "torchscript" else None)  # fmt: skip
        compiled = kept(artifact, dtype, device) if artifact is not None else None
        if compiled is not None:  # checked against this model before: no eager model needed
            return TorchBackend(None, device, dtype, shape, compile_mode=mode,
                                cuda_graphs=graphs, compiled=compiled,
                                compiled_artifact=artifact)  # fmt: skip
        # .to(dtype) changes a module in place: each of several candidates converts a copy,
        # and so does one that is checked, so that the loaded module stays the fp32 reference.
        checked = checked_against_eager("torch", NAMES[dtype], device)
        alone = len(candidates) == 1 and not checked
        module = loaded.module if alone else copy.deepcopy(loaded.module)
        return TorchBackend(
            module, device, dtype, shape, compile_mode=mode, cuda_graphs=graphs,
            compiled_artifact=artifact,
        )  # fmt: skip

    names = [NAMES[dtype] for dtype in candidates]
    with build.phases.phase("compile"):  # TorchScript: traced and frozen, or loaded
        backend, rates = fastest(names, candidate, shape, build.rows, build.failures_of,
                                 build.machine.rate)  # fmt: skip
    backend.measured_rates = rates
    return backend


# -- inference runtimes -------------------------------------------------------------------


def runtime_precisions(
    config: ModelConfig, device: torch.device, native_bf16: bool
) -> tuple[str, ...]:
    """The precisions a runtime may serve here, most accurate first. ``PRECISION=auto`` is
    fp32, and on a CPU with native bf16 kernels OpenVINO's bf16 too, measured against it as
    PyTorch's precisions are (resnet18's forward pass: 224 images/s in bf16 against 105 in fp32
    on a 2-core AVX512-BF16 AMD EPYC, ``benchmarks/results/backends-resnet18-amd-epyc-bf16.md``).
    An explicit precision is checked against what the runtime serves."""
    supported = {
        ("onnxruntime", "cpu"): ("fp32", "int8"),
        ("onnxruntime", "cuda"): ("fp32", "fp16"),
        ("openvino", "cpu"): ("fp32", "bf16", "int8"),
    }.get((config.backend, device.type), ())
    if config.precision == "auto" and "fp32" in supported:
        bf16 = "bf16" in supported and native_bf16
        return ("fp32", "bf16") if bf16 else ("fp32",)
    if config.precision not in supported:
        served = " or ".join(supported) or "nothing"
        raise StartupError(
            f"BACKEND={config.backend} on {device.type} serves {served}, "
            f"not PRECISION={config.precision}"
        )
    return (config.precision,)


def _runtime_backend(config: ModelConfig, loaded: LoadedModel, build: _Build) -> Backend:
    device, batching, phases = build.device, build.batching, build.phases
    native_bf16 = build.machine.native_bf16
    precisions = runtime_precisions(config, device, native_bf16)
    root = config.artifacts_dir
    gate = None
    with phases.phase("artefacts"):  # found, or exported, converted or quantised now
        if precisions == ("int8",):
            path, gate = gated_int8(config, loaded, build.machine.rate)
        elif config.backend == "onnxruntime":
            path = ensure_onnx(root, loaded)
        else:  # one IR for every precision: OpenVINO converts when it compiles
            path = ensure_openvino(root, loaded, "fp32")
        box_head = ensure_box_head(root, loaded, config.backend)
    from app.engine.int8.int8_report import digest_ahead

    digest_ahead(path)  # for the start-up check's binding, while the runtime compiles

    # Batches that run one at a time (a CPU: the second slot only gets ready ahead) want one
    # OpenVINO stream with every thread; THROUGHPUT would give each of two streams half of
    # the threads while only one of them computes.
    concurrent = 1 if batching.serial_execution else batching.max_inflight_batches

    decode = runtime_decode(loaded)

    def candidate(precision: str) -> Backend:
        return open_runtime(config.backend, path, precision=precision,
                            threads=config.threads, classes=len(loaded.labels),
                            device=device, concurrent_batches=concurrent,
                            decode=decode, box_head=box_head)  # fmt: skip

    with phases.phase("compile"):  # the runtime's session or compiled model (per precision)
        backend, rates = fastest(precisions, candidate, input_shape(loaded), build.rows,
                                 build.failures_of, build.machine.rate)  # fmt: skip
    backend.measured_rates = rates or None
    backend.int8_gate = gate
    return backend

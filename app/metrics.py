"""Prometheus metrics: the batcher's, the engine's, the pipeline stages' and the device's.

What belongs to one model version (its queue, batches, stages, device time) carries ``model``
and ``version`` labels, recorded through that version's view (``Metrics.version``), which is
its batcher's and engine's observer; a version that is unloaded takes its series with it. What
belongs to the process (admission, the lifecycle) has none. Each app gets its own registry, so
several apps (tests, a benchmark) can live in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from app.engine.observer import BatchReport, EngineObserver
from app.serving.lifecycle import Phase
from batching import BatchObserver
from batching.observer import DropReason, RejectReason

OUTCOMES = (
    "ok",
    "invalid",
    "unauthorized",
    "overloaded",
    "not_ready",
    "deadline_exceeded",
    "cancelled",
    "error",
)
ROUTES = ("predict", "v2_infer", "grpc_infer")
# Per request: parse, decode (on the CPU, with resize and crop), serialize.
REQUEST_STAGES = ("parse", "decode", "serialize")
# Per batch: device_decode (JPEGs decoded on the device), h2d, collate, forward, postprocess,
# d2h; timed with CUDA events on a GPU.
BATCH_STAGES = ("device_decode", "h2d", "collate", "forward", "postprocess", "d2h")
STAGES = REQUEST_STAGES + BATCH_STAGES

_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
_VERSION = ["model", "version"]


class Metrics:
    """All of batchserve's own metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.queue_depth = Gauge(
            "batchserve_queue_depth", "Requests waiting to be batched", _VERSION, registry=r
        )
        self.admitted_bytes = Gauge(
            "batchserve_admitted_bytes",
            "Encoded bytes held by admitted requests not yet dispatched (bounded by "
            "MAX_QUEUE_BYTES)",
            registry=r,
        )
        self.admitted_requests = Gauge(
            "batchserve_admitted_requests",
            "Admitted requests not yet dispatched: being read, decoded or queued "
            "(bounded by MAX_QUEUE_SIZE)",
            registry=r,
        )
        self.admission_limit = Gauge(
            "batchserve_admission_limit",
            "MAX_QUEUE_SIZE (resource=requests) and MAX_QUEUE_BYTES (resource=bytes)",
            ["resource"],
            registry=r,
        )
        self.inflight_batches = Gauge(
            "batchserve_inflight_batches",
            "Batches being prepared or executed",
            _VERSION,
            registry=r,
        )
        self.batch_size = Histogram(
            "batchserve_batch_size",
            "Requests per executed batch",
            _VERSION,
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.canvas_batch_size = Histogram(
            "batchserve_canvas_batch_size",
            "Images per forward pass, by the input shape they share (height x width): images "
            "of other shapes are not batched together",
            ["canvas", *_VERSION],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "batchserve_queue_wait_seconds",
            "Submit to dispatch, per dispatched request (dropped ones are counted apart)",
            _VERSION,
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "batchserve_stage_seconds",
            "Time per pipeline stage: parse, decode, serialize per request; device_decode, h2d, "
            "collate, forward, postprocess, d2h per batch",
            ["stage", *_VERSION],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "batchserve_requests",
            "Every answer of the prediction routes, by route, outcome and model (empty when the "
            "request named none that exists)",
            ["route", "outcome", "model"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "batchserve_request_duration_seconds",
            "Time from a prediction request's arrival to its answer, by route, outcome and "
            "model, for the same answers as batchserve_requests_total",
            ["route", "outcome", "model"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "batchserve_rejected_requests",
            "Requests refused at once, by reason",
            ["reason", "model"],
            registry=r,
        )
        self.dropped = Counter(
            "batchserve_dropped_requests",
            "Requests that left the queue undispatched, by reason",
            ["reason", *_VERSION],
            registry=r,
        )
        self.expired_in_flight = Counter(
            "batchserve_expired_in_flight",
            "Requests whose deadline passed while their batch ran (result discarded)",
            _VERSION,
            registry=r,
        )
        self.batches = Counter(
            "batchserve_batches", "Executed batches by result", ["result", *_VERSION], registry=r
        )
        self.padding_rows = Counter(
            "batchserve_padding_rows",
            "Rows computed only to pad batches to a fixed shape (CUDA graphs, inductor)",
            _VERSION,
            registry=r,
        )
        self.device_busy = Counter(
            "batchserve_device_busy_seconds",
            "Device time from each batch's forward pass to the end of its readback "
            "(its rate is the compute utilisation; summed over the models of a device)",
            ["device", *_VERSION],
            registry=r,
        )
        self.device_preprocess = Counter(
            "batchserve_device_preprocess_seconds",
            "Device time spent preparing batches: decoding on the device, copies, normalisation "
            "(on a GPU it overlaps the forward pass of the previous batch)",
            ["device", *_VERSION],
            registry=r,
        )
        self.decode_fallbacks = Counter(
            "batchserve_decode_fallbacks",
            "Images decoded on the CPU because the device's JPEG decoder failed them",
            _VERSION,
            registry=r,
        )
        self.model_info = Gauge(
            "batchserve_model_info",
            'Each model version being served (always 1); weights is "random" when they are; '
            "choice says why MODEL=auto serves another model than resnet50 (empty: it does not)",
            [*_VERSION, "device", "precision", "backend", "weights", "task", "choice"],
            registry=r,
        )
        self.ready = Gauge("batchserve_ready", "1 while /readyz answers 200", registry=r)
        self.model_ready = Gauge(
            "batchserve_model_ready", "1 while a model version serves", _VERSION, registry=r
        )
        self.state = Gauge(
            "batchserve_state", "1 for the server's current lifecycle phase", ["state"], registry=r
        )
        self.startup = Gauge(
            "batchserve_startup_seconds",
            "How long this process's start took, by phase (models loaded at start added up); "
            'phase="ready" is the process\'s age when it turned ready',
            ["phase"],
            registry=r,
        )
        self._gpu_memory: dict[str, Gauge] = {}
        self._gpu_devices: set[str] = set()
        self._request_children: dict[tuple[str, str, str], Any] = {}
        self._duration_children: dict[tuple[str, str, str], Any] = {}
        self._versions: dict[tuple[str, str], VersionMetrics] = {}
        self._state_children = {phase: self.state.labels(phase.value) for phase in Phase}

    def track(
        self, admitted_bytes: Callable[[], float], admitted_requests: Callable[[], float]
    ) -> None:
        """Read the admission gauges at scrape time rather than on every request."""
        self.admitted_bytes.set_function(admitted_bytes)
        self.admitted_requests.set_function(admitted_requests)

    def version(self, model: str, version: str) -> VersionMetrics:
        """The view that records one model version's metrics (made on first use)."""
        key = (model, version)
        if key not in self._versions:
            self._versions[key] = VersionMetrics(self, model, version)
        return self._versions[key]

    def forget(self, model: str, version: str) -> None:
        """Remove an unloaded version's series."""
        view = self._versions.pop((model, version), None)
        if view is not None:
            view.remove()

    def limits(self, requests: int, encoded_bytes: int) -> None:
        self.admission_limit.labels("requests").set(requests)
        self.admission_limit.labels("bytes").set(encoded_bytes)

    def started(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.startup.labels(phase).set(value)

    def on_phase(self, phase: Phase) -> None:
        """A lifecycle listener."""
        self.ready.set(1 if phase is Phase.READY else 0)
        for each, child in self._state_children.items():
            child.set(1 if each is phase else 0)

    def track_cuda(self, device: torch.device) -> None:
        """GPU memory from PyTorch's allocator and, when NVML is installed, utilisation: one
        series per device, made the first time a model version is served on it."""
        name = str(device)
        if name in self._gpu_devices:
            return
        self._gpu_devices.add(name)
        if not self._gpu_memory:
            r = self.registry
            self._gpu_memory = {
                "allocated": Gauge("batchserve_gpu_memory_allocated_bytes",
                                   "Memory held by tensors", ["device"], registry=r),
                "reserved": Gauge("batchserve_gpu_memory_reserved_bytes",
                                  "Memory held by the caching allocator", ["device"], registry=r),
                "utilization": Gauge("batchserve_gpu_utilization_ratio",
                                     "NVML: share of time a kernel ran", ["device"], registry=r),
            }  # fmt: skip
        gauges = self._gpu_memory
        gauges["allocated"].labels(name).set_function(lambda: torch.cuda.memory_allocated(device))
        gauges["reserved"].labels(name).set_function(lambda: torch.cuda.memory_reserved(device))
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # no NVML (nvidia-ml-py not installed, or no driver access)
            return
        gauges["utilization"].labels(name).set_function(
            lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        )

    def requests_of(self, model: str) -> None:
        """Every route and outcome of ``model`` counted from zero (so that rates exist)."""
        for route in ROUTES:
            for outcome in OUTCOMES:
                key = (route, outcome, model)
                if key not in self._request_children:
                    self._request_children[key] = self.requests.labels(*key)

    def count_request(self, route: str, outcome: str, model: str, seconds: float) -> None:
        """One answer of a prediction route, and the ``seconds`` it took."""
        key = (route, outcome, model)
        count = self._request_children.get(key)
        if count is None:
            count = self._request_children[key] = self.requests.labels(*key)
        count.inc()
        # Created at the first answer of its kind: zero series for every outcome would say
        # nothing a rate of the counter does not.
        duration = self._duration_children.get(key)
        if duration is None:
            duration = self._duration_children[key] = self.request_seconds.labels(*key)
        duration.observe(seconds)

    def on_reject(self, reason: str, model: str = "") -> None:
        self.rejected.labels(reason, model).inc()


class VersionMetrics(BatchObserver, EngineObserver):
    """One model version's metrics: its batcher's and its engine's observer."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._metrics = metrics
        metrics.requests_of(model)
        self.model, self.version = model, version
        labels = (model, version)
        self._labels = labels
        self._families: list[Any] = [
            metrics.queue_depth, metrics.inflight_batches, metrics.batch_size,
            metrics.queue_wait, metrics.expired_in_flight, metrics.padding_rows,
            metrics.decode_fallbacks, metrics.model_ready,
        ]  # fmt: skip
        self._canvases: set[str] = set()
        self._batch_size = metrics.batch_size.labels(*labels)
        self._queue_wait = metrics.queue_wait.labels(*labels)
        self._expired = metrics.expired_in_flight.labels(*labels)
        self._padding = metrics.padding_rows.labels(*labels)
        self._fallbacks = metrics.decode_fallbacks.labels(*labels)
        self._stages = {stage: metrics.stage.labels(stage, *labels) for stage in STAGES}
        self._batches = {result: metrics.batches.labels(result, *labels)
                         for result in ("ok", "error")}  # fmt: skip
        self._busy: Any = None
        self._preprocess: Any = None
        self._device = ""
        self._info: tuple[str, ...] | None = None

    def serving(
        self,
        device: torch.device,
        precision: str,
        backend: str,
        weights: str,
        queue_depth: Callable[[], float],
        inflight: Callable[[], float],
        task: str = "classify",
        choice: str = "",
    ) -> None:
        """The version is loaded: what it runs on, and its gauges (read at scrape time)."""
        metrics, labels = self._metrics, self._labels
        self._device = str(device)
        self._busy = metrics.device_busy.labels(self._device, *labels)
        self._preprocess = metrics.device_preprocess.labels(self._device, *labels)
        self._info = (*labels, self._device, precision, backend, weights, task, choice)
        metrics.model_info.labels(*self._info).set(1)
        if device.type == "cuda":
            metrics.track_cuda(device)
        metrics.queue_depth.labels(*labels).set_function(queue_depth)
        metrics.inflight_batches.labels(*labels).set_function(inflight)

    def ready(self, ready: bool) -> None:
        self._metrics.model_ready.labels(*self._labels).set(1 if ready else 0)

    def remove(self) -> None:
        metrics, labels = self._metrics, self._labels
        for family in self._families:
            _remove(family, labels)
        for stage in STAGES:
            _remove(metrics.stage, (stage, *labels))
        for canvas in self._canvases:
            _remove(metrics.canvas_batch_size, (canvas, *labels))
        for result in ("ok", "error"):
            _remove(metrics.batches, (result, *labels))
        for reason in ("cancelled", "deadline_exceeded", "displaced"):
            _remove(metrics.dropped, (reason, *labels))
        if self._device:
            _remove(metrics.device_busy, (self._device, *labels))
            _remove(metrics.device_preprocess, (self._device, *labels))
        if self._info is not None:
            _remove(metrics.model_info, self._info)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._stages[stage].observe(seconds)

    # -- EngineObserver ------------------------------------------------------------------

    def on_batch(self, report: BatchReport) -> None:
        for stage, seconds in report.stages.items():
            self._stages[stage].observe(seconds)
        if self._busy is not None:
            self._busy.inc(report.busy_s)
            self._preprocess.inc(report.preprocess_s)
        if report.padded_rows > report.rows:
            self._padding.inc(report.padded_rows - report.rows)
        canvas = f"{report.canvas[0]}x{report.canvas[1]}"
        self._canvases.add(canvas)
        self._metrics.canvas_batch_size.labels(canvas, *self._labels).observe(report.rows)

    def on_decode_fallbacks(self, count: int) -> None:
        self._fallbacks.inc(count)

    # -- BatchObserver -------------------------------------------------------------------

    def on_reject(self, reason: RejectReason) -> None:
        self._metrics.on_reject(reason, self.model)

    def on_drop(self, reason: DropReason, queue_wait_s: float) -> None:
        self._metrics.dropped.labels(reason, *self._labels).inc()

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self._batch_size.observe(batch_size)
        observe = self._queue_wait.observe
        for wait in queue_waits_s:
            observe(wait)

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        self._batches["ok" if error is None else "error"].inc()

    def on_expired_in_flight(self) -> None:
        self._expired.inc()


def _remove(family: Any, labels: Sequence[str]) -> None:
    with contextlib.suppress(KeyError):
        family.remove(*labels)

"""Prometheus metrics: the batcher's, the engine's, the pipeline stages' and the device's.

Each app gets its own registry, so several apps (tests, a benchmark) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from app.engine.observer import BatchReport, EngineObserver
from app.lifecycle import Phase
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
ROUTES = ("predict", "v2_infer")
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


class Metrics(BatchObserver, EngineObserver):
    """All of batchserve's own metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.queue_depth = Gauge(
            "batchserve_queue_depth", "Requests waiting to be batched", registry=r
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
            "batchserve_inflight_batches", "Batches being prepared or executed", registry=r
        )
        self.batch_size = Histogram(
            "batchserve_batch_size",
            "Requests per executed batch",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "batchserve_queue_wait_seconds",
            "Submit to dispatch, per dispatched request (dropped ones are counted apart)",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "batchserve_stage_seconds",
            "Time per pipeline stage: parse, decode, serialize per request; device_decode, h2d, "
            "collate, forward, postprocess, d2h per batch",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "batchserve_requests",
            "Every answer of the prediction routes, by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "batchserve_rejected_requests",
            "Requests refused by the batcher at once, by reason",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "batchserve_dropped_requests",
            "Requests that left the queue undispatched, by reason",
            ["reason"],
            registry=r,
        )
        self.expired_in_flight = Counter(
            "batchserve_expired_in_flight",
            "Requests whose deadline passed while their batch ran (result discarded)",
            registry=r,
        )
        self.batches = Counter(
            "batchserve_batches", "Executed batches by result", ["result"], registry=r
        )
        self.padding_rows = Counter(
            "batchserve_padding_rows",
            "Rows computed only to pad batches to a fixed shape (CUDA graphs, inductor)",
            registry=r,
        )
        self.device_busy = Counter(
            "batchserve_device_busy_seconds",
            "Device time from each batch's forward pass to the end of its readback "
            "(its rate is the compute utilisation)",
            registry=r,
        )
        self.device_preprocess = Counter(
            "batchserve_device_preprocess_seconds",
            "Device time spent preparing batches: decoding on the device, copies, normalisation "
            "(on a GPU it overlaps the forward pass of the previous batch)",
            registry=r,
        )
        self.model_info = Gauge(
            "batchserve_model_info",
            "The served model (always 1)",
            ["model", "device", "precision", "backend"],
            registry=r,
        )
        self.ready = Gauge("batchserve_ready", "1 while /readyz answers 200", registry=r)
        self.state = Gauge(
            "batchserve_state", "1 for the server's current lifecycle phase", ["state"], registry=r
        )
        self._request_children = {
            (route, outcome): self.requests.labels(route, outcome)
            for route in ROUTES
            for outcome in OUTCOMES
        }
        for result in ("ok", "error"):
            self.batches.labels(result)
        self._stage_children = {stage: self.stage.labels(stage) for stage in STAGES}
        self._state_children = {phase: self.state.labels(phase.value) for phase in Phase}

    def track(
        self,
        queue_depth: Callable[[], float],
        inflight: Callable[[], float],
        admitted_bytes: Callable[[], float],
        admitted_requests: Callable[[], float] | None = None,
    ) -> None:
        """Read the gauges at scrape time rather than on every request."""
        self.queue_depth.set_function(queue_depth)
        self.inflight_batches.set_function(inflight)
        self.admitted_bytes.set_function(admitted_bytes)
        if admitted_requests is not None:
            self.admitted_requests.set_function(admitted_requests)

    def limits(self, requests: int, encoded_bytes: int) -> None:
        self.admission_limit.labels("requests").set(requests)
        self.admission_limit.labels("bytes").set(encoded_bytes)

    def on_phase(self, phase: Phase) -> None:
        """A lifecycle listener."""
        self.ready.set(1 if phase is Phase.READY else 0)
        for each, child in self._state_children.items():
            child.set(1 if each is phase else 0)

    def track_cuda(self, device: torch.device) -> None:
        """GPU memory from PyTorch's allocator; utilisation from NVML when it is installed."""
        r = self.registry
        Gauge(
            "batchserve_gpu_memory_allocated_bytes", "Memory held by tensors", registry=r
        ).set_function(lambda: torch.cuda.memory_allocated(device))
        Gauge(
            "batchserve_gpu_memory_reserved_bytes",
            "Memory held by the caching allocator",
            registry=r,
        ).set_function(lambda: torch.cuda.memory_reserved(device))
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # no NVML (nvidia-ml-py not installed, or no driver access)
            return
        Gauge(
            "batchserve_gpu_utilization_ratio", "NVML: share of time a kernel ran", registry=r
        ).set_function(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._stage_children[stage].observe(seconds)

    def count_request(self, route: str, outcome: str) -> None:
        self._request_children[route, outcome].inc()

    # -- EngineObserver ------------------------------------------------------------------

    def on_batch(self, report: BatchReport) -> None:
        for stage, seconds in report.stages.items():
            self._stage_children[stage].observe(seconds)
        self.device_busy.inc(report.busy_s)
        self.device_preprocess.inc(report.preprocess_s)
        if report.padded_rows > report.rows:
            self.padding_rows.inc(report.padded_rows - report.rows)

    # -- BatchObserver -------------------------------------------------------------------

    def on_reject(self, reason: RejectReason) -> None:
        self.rejected.labels(reason).inc()

    def on_drop(self, reason: DropReason, queue_wait_s: float) -> None:
        self.dropped.labels(reason).inc()

    def on_dispatch(self, batch_size: int, queue_waits_s: Sequence[float]) -> None:
        self.batch_size.observe(batch_size)
        observe = self.queue_wait.observe
        for wait in queue_waits_s:
            observe(wait)

    def on_complete(self, batch_size: int, duration_s: float, error: BaseException | None) -> None:
        self.batches.labels("ok" if error is None else "error").inc()

    def on_expired_in_flight(self) -> None:
        self.expired_in_flight.inc()

"""The CUDA path's ordering, checked on a CPU: recording fakes of ``torch.cuda``'s streams,
events and graphs patched into a CPU engine. They record which stream each stage runs on,
what each stream waits for, and when each event is waited on; an event's ``synchronize``
takes a moment, as a GPU's work would, so that a slot handed on too early is seen.

Also here, what else of the GPU path a CPU can check: the device JPEG decoder's probe and
fallback count, batched resizing, the GPU memory gauges, and the fp16 start-up check."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from app.engine import ImageRequest, InferenceEngine
from app.engine.checks.startup_check import checked_against_eager
from app.engine.device import DeviceError, resolve_decode_device
from app.engine.observer import EngineObserver
from app.engine.pipeline.graphs import CudaGraphs
from app.engine.pipeline.streams import CudaStreams
from app.metrics import Metrics
from preprocessing import device as device_decode
from preprocessing import transforms as transforms_module
from preprocessing.device import probe_decoder
from preprocessing.staging import PinnedStaging
from preprocessing.transforms import fit
from tests import images
from tests.checks import metric
from tests.engines import torch_engine

GPU_WORK_S = 0.01  # how long a fake event takes to complete once waited on


@dataclass
class Entry:
    kind: str  # enter, record, wait, sync_event, sync_stream, forward
    thread: int
    stream: Any = None
    event: Any = None


@dataclass
class Recorder:
    """Every stream operation, in order, from every thread."""

    entries: list[Entry] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def add(self, kind: str, stream: Any = None, event: Any = None) -> None:
        with self.lock:
            self.entries.append(Entry(kind, threading.get_ident(), stream, event))

    @property
    def current(self) -> Any:
        return getattr(self.local, "stream", "default")


class FakeStream:
    count = 0

    def __init__(self, recorder: Recorder) -> None:
        FakeStream.count += 1
        self.name, self.recorder = f"stream-{FakeStream.count}", recorder

    def wait_event(self, event: FakeEvent) -> None:
        self.recorder.add("wait", self, event)

    def wait_stream(self, other: Any) -> None:
        self.recorder.add("wait_stream", self, other)

    def synchronize(self) -> None:
        time.sleep(GPU_WORK_S)
        self.recorder.add("sync_stream", self)

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.stream, self.at = recorder, None, 0.0

    def record(self) -> None:
        self.stream, self.at = self.recorder.current, time.perf_counter()
        self.recorder.add("record", self.stream, self)

    def synchronize(self) -> None:
        time.sleep(GPU_WORK_S)
        self.recorder.add("sync_event", self.stream, self)

    def elapsed_time(self, later: FakeEvent) -> float:
        return (later.at - self.at) * 1000


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """``torch.cuda``'s Stream, Event and stream() replaced by recording fakes."""
    log = Recorder()

    @contextlib.contextmanager
    def stream(chosen: FakeStream) -> Iterator[None]:
        previous = log.current
        log.local.stream = chosen
        log.add("enter", chosen)
        try:
            yield
        finally:
            log.local.stream = previous

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log


def on_fake_cuda(engine: InferenceEngine, recorder: Recorder) -> CudaStreams:
    """``engine`` (on the CPU) with CUDA's streams and events, and slots that carry them."""
    streams = CudaStreams(torch.device("cpu"))
    engine._streams = streams
    engine._collator.streams = streams
    engine._slots = PinnedStaging(engine._make_slot, size=engine.max_inflight_batches)
    forward = engine.backend.forward

    def recorded(batch: torch.Tensor, sizes: Any = None) -> Any:
        recorder.add("forward", recorder.current)
        return forward(batch, sizes)

    engine.backend.forward = recorded  # type: ignore[method-assign]
    return streams


def requests(engine: InferenceEngine, count: int, seed: int = 0) -> list[ImageRequest]:
    return [
        ImageRequest(engine.prepare(images.jpeg(images.photo(80, 60, seed=seed + index))))
        for index in range(count)
    ]


def fake_engine(recorder: Recorder, **options: Any) -> tuple[InferenceEngine, CudaStreams]:
    engine = torch_engine(max_batch_size=4, max_inflight_batches=2, **options)
    return engine, on_fake_cuda(engine, recorder)


def batches_of(entries: list[Entry], slot_streams: set[Any]) -> list[list[Entry]]:
    """Each batch's entries: from a thread's entering a slot's stream to its next one."""
    by_thread: dict[int, list[list[Entry]]] = {}
    for entry in entries:
        runs = by_thread.setdefault(entry.thread, [])
        if entry.kind == "enter" and entry.stream in slot_streams:
            runs.append([])
        if runs:
            runs[-1].append(entry)
    return [run for runs in by_thread.values() for run in runs]


def test_each_stage_runs_on_its_stream_and_compute_waits_for_its_batch(
    recorder: Recorder,
) -> None:
    engine, streams = fake_engine(recorder)
    slot_streams = {slot.stream for slot in engine.slots}
    with ThreadPoolExecutor(3) as pool:
        work = [requests(engine, 3, seed) for seed in range(9)]
        outcomes = list(pool.map(engine.run_batch, work))
    assert all(not isinstance(each, BaseException) for outcome in outcomes for each in outcome)
    batches = batches_of(recorder.entries, slot_streams)
    assert len(batches) == 9
    for batch in batches:
        slot = batch[0].stream
        compute = next(
            index
            for index, entry in enumerate(batch)
            if entry.kind == "enter" and entry.stream is streams.compute_stream
        )
        before, after = batch[:compute], batch[compute:]
        # Preprocessing's marks on the slot's stream, the forward pass's on the compute one.
        assert {entry.stream for entry in before if entry.kind == "record"} == {slot}
        assert [entry.stream for entry in after if entry.kind == "forward"] == [
            streams.compute_stream
        ]
        assert {entry.stream for entry in after if entry.kind == "record"} == {
            streams.compute_stream
        }
        # The compute stream waits for this batch's last preprocessing event (collated).
        collated = [entry.event for entry in before if entry.kind == "record"][-1]
        waits = [entry for entry in before if entry.kind == "wait"]
        assert [(w.stream, w.event) for w in waits] == [(streams.compute_stream, collated)]
        # The host waits for the batch's own done event only: never a whole stream.
        done = [entry.event for entry in after if entry.kind == "record"][-1]
        assert [entry.event for entry in after if entry.kind == "sync_event"] == [done]
        assert not [entry for entry in batch if entry.kind == "sync_stream"]


def test_a_slot_is_reused_only_after_its_batch_is_done(recorder: Recorder) -> None:
    engine, _ = fake_engine(recorder)
    slot_streams = {slot.stream for slot in engine.slots}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(engine.run_batch, [requests(engine, 2, seed) for seed in range(12)]))
    busy: dict[Any, bool] = {}
    owner: dict[int, Any] = {}
    for entry in recorder.entries:
        if entry.kind == "enter" and entry.stream in slot_streams:
            assert not busy.get(entry.stream), f"{entry.stream} handed on before its batch ended"
            busy[entry.stream], owner[entry.thread] = True, entry.stream
        elif entry.kind in ("sync_event", "sync_stream") and entry.thread in owner:
            busy[owner.pop(entry.thread)] = False


def test_a_failed_batch_settles_both_streams_before_its_slot_is_reused(
    recorder: Recorder,
) -> None:
    engine, streams = fake_engine(recorder)
    forward = engine.backend.forward
    calls = 0

    def failing_once(batch: torch.Tensor, sizes: Any = None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("an illegal memory access")
        return forward(batch, sizes)

    engine.backend.forward = failing_once  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.run_batch(requests(engine, 2))
    settled = [entry.stream for entry in recorder.entries if entry.kind == "sync_stream"]
    slot = next(entry.stream for entry in recorder.entries if entry.kind == "enter")
    assert settled == [slot, streams.compute_stream]
    again = engine.run_batch(requests(engine, 2))
    assert all(not isinstance(each, BaseException) for each in again)


def test_no_capture_overlaps_another_engines_forward_pass(recorder: Recorder) -> None:
    """A second engine on the same device prepares (captures its graphs) while the first
    serves: the device's lock keeps every forward pass of the first out of the capture."""
    lock = threading.Lock()
    serving, _ = fake_engine(recorder, device_lock=lock)
    loading, _ = fake_engine(recorder, device_lock=lock)
    intervals: list[tuple[str, float, float]] = []
    forward = serving.backend.forward

    def timed(batch: torch.Tensor, sizes: Any = None) -> Any:
        started = time.perf_counter()
        result = forward(batch, sizes)
        time.sleep(0.002)
        intervals.append(("forward", started, time.perf_counter()))
        return result

    def capture(buckets: Any) -> None:
        started = time.perf_counter()
        time.sleep(0.2)
        intervals.append(("capture", started, time.perf_counter()))

    serving.backend.forward = timed  # type: ignore[method-assign]
    loading.backend.prepare = capture  # type: ignore[method-assign]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            serving.run_batch(requests(serving, 1))

    with ThreadPoolExecutor(2) as pool:
        workers = [pool.submit(serve) for _ in range(2)]
        time.sleep(0.05)
        loading.warmup((1,), rounds=1)
        stop.set()
        for worker in workers:
            worker.result()
    (captured,) = [(start, end) for kind, start, end in intervals if kind == "capture"]
    forwards = [(start, end) for kind, start, end in intervals if kind == "forward"]
    assert forwards
    overlapping = [f for f in forwards if f[0] < captured[1] and captured[0] < f[1]]
    assert not overlapping, f"{len(overlapping)} forward passes ran during the capture"


def test_graphs_capture_thread_local_with_cudnn_autotuning_only_meanwhile(
    monkeypatch: pytest.MonkeyPatch, recorder: Recorder
) -> None:
    captures: list[dict[str, Any]] = []

    class FakeGraph:
        def replay(self) -> None:
            pass

    @contextlib.contextmanager
    def graph(cuda_graph: FakeGraph, **options: Any) -> Iterator[None]:
        captures.append({**options, "benchmark": torch.backends.cudnn.benchmark})
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(recorder))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    shapes: list[int] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        shapes.append(batch.shape[0])
        return batch.mean(dim=(1, 2, 3))

    graphs = CudaGraphs(model, [1, 4, 2], (3, 8, 8), torch.float32, torch.device("cpu"))
    assert graphs.buckets == [1, 2, 4]
    assert [c["capture_error_mode"] for c in captures] == ["thread_local"] * 3
    assert all(c["benchmark"] for c in captures)
    assert all(c["pool"] == "pool" for c in captures)
    assert torch.backends.cudnn.benchmark is False  # restored once captured
    assert shapes[::4] == [4, 2, 1]  # largest first: three warm-up passes, then the capture


# -- the device's JPEG decoder ---------------------------------------------------------


def broken_decoder(data: Any, device: Any) -> Any:
    raise AttributeError("module 'torchvision.io' has no nvjpeg")  # libnvjpeg did not load


def test_the_decoder_probe_says_why_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    assert probe_decoder(torch.device("cpu")) is None
    monkeypatch.setattr(device_decode, "_decode", broken_decoder)
    reason = probe_decoder(torch.device("cpu"))
    assert reason is not None
    assert reason.startswith("AttributeError")


def test_a_failing_decoder_means_cpu_decoding_with_auto_and_refusal_with_cuda(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = torch.device("cuda")

    def fails(device: torch.device) -> str:
        return "AttributeError: no nvjpeg"

    with caplog.at_level(logging.CRITICAL, "batchserve"):
        assert resolve_decode_device("auto", gpu, fails) is False
    assert "decoded on the CPU, not on cuda" in caplog.text
    with pytest.raises(DeviceError, match="failed a test image: AttributeError"):
        resolve_decode_device("cuda", gpu, fails)


class CountingObserver(EngineObserver):
    def __init__(self) -> None:
        self.fallbacks = 0

    def on_decode_fallbacks(self, count: int) -> None:
        self.fallbacks += count


def test_every_image_the_cpu_decodes_instead_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    observer = CountingObserver()
    engine = torch_engine(max_batch_size=4, decode_on_device=True, observer=observer)
    batch = [ImageRequest(engine.prepare(images.jpeg(images.photo(90, 70, seed=s))))
             for s in range(3)]  # fmt: skip
    expected = engine.run_batch(batch)
    assert observer.fallbacks == 0
    monkeypatch.setattr(device_decode, "_decode", broken_decoder)
    answered = engine.run_batch(batch)
    assert observer.fallbacks == 3
    for before, after in zip(expected, answered, strict=True):
        assert not isinstance(before, BaseException)
        assert not isinstance(after, BaseException)
        assert before.classes == after.classes


def test_pictures_of_one_size_are_resized_as_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = torch_engine(max_batch_size=8, decode_on_device=True)
    sizes = [(120, 90)] * 4 + [(64, 100), (64, 100), (200, 150)]
    batch = [ImageRequest(engine.prepare(images.jpeg(images.photo(w, h, seed=s))))
             for s, (w, h) in enumerate(sizes)]  # fmt: skip
    calls: list[int] = []
    interpolate = torch.nn.functional.interpolate

    def counted(batch: torch.Tensor, **options: Any) -> torch.Tensor:
        calls.append(batch.shape[0])
        return interpolate(batch, **options)

    monkeypatch.setattr(transforms_module, "interpolate", counted)
    answered = engine.run_batch(batch)
    # One resize per size (across, then down), not one per picture.
    assert sorted(calls) == [1, 1, 2, 2, 4, 4]
    # The same answers as each picture fitted on its own.
    monkeypatch.setattr(engine._collator, "_fitted", lambda pictures, placements: {
        index: fit(picture, engine.transform, placements[index])
        for index, picture in pictures.items()})  # fmt: skip
    alone = engine.run_batch(batch)
    for together, single in zip(answered, alone, strict=True):
        assert not isinstance(together, BaseException)
        assert not isinstance(single, BaseException)
        assert together.classes == single.classes


# -- the rest of the GPU path ----------------------------------------------------------


def test_gpu_memory_gauges_are_served_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 123)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 456)
    metrics = Metrics()
    for model in ("a", "b"):  # two models on one GPU: one series, no duplicate
        metrics.version(model, "1").serving(
            torch.device("cuda", 0), "fp16", "torch", "w", lambda: 0, lambda: 0
        )
    text = generate_latest(metrics.registry).decode()
    assert metric(text, 'batchserve_gpu_memory_allocated_bytes{device="cuda:0"}') == 123
    assert metric(text, 'batchserve_gpu_memory_reserved_bytes{device="cuda:0"}') == 456
    cpu = Metrics()
    cpu.version("a", "1").serving(torch.device("cpu"), "fp32", "torch", "w", lambda: 0, lambda: 0)
    assert "batchserve_gpu_memory" not in generate_latest(cpu.registry).decode()


def test_fp16_and_bf16_are_checked_against_eager_fp32_on_a_gpu_too() -> None:
    gpu = torch.device("cuda")
    assert checked_against_eager("torch", "fp16", gpu)
    assert checked_against_eager("torch", "bf16", gpu)
    assert not checked_against_eager("torch", "fp32", gpu)

"""Checks of the engine's batch pipeline that mean most on a GPU, shared by ``gpu_check`` and
the CUDA-marked tests: does batch N+1's forward pass start before batch N's results are back,
are concurrent batches free of mix-ups, and what does padding to a bucket cost.

They run on a CPU too (and are tested there), where they say little: work is synchronous.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from app.engine import (
    BatchReport,
    EngineObserver,
    ImageRequest,
    InferenceEngine,
    Prediction,
    bucket_for,
)


class ReportLog(EngineObserver):
    """Keeps every batch report (thread-safe: batches report from their own threads)."""

    def __init__(self) -> None:
        self.reports: list[BatchReport] = []
        self._lock = threading.Lock()

    def on_batch(self, report: BatchReport) -> None:
        with self._lock:
            self.reports.append(report)


def _batches(engine: InferenceEngine, images: Sequence[bytes], size: int, count: int
             ) -> list[list[ImageRequest]]:  # fmt: skip
    return [
        [ImageRequest(engine.prepare(images[(b * size + i) % len(images)]), 5)
         for i in range(size)]
        for b in range(count)
    ]  # fmt: skip


def _run_concurrently(
    engine: InferenceEngine, batches: list[list[ImageRequest]], threads: int
) -> list[list[Prediction | BaseException]]:
    results: list[list[Prediction | BaseException]] = [[] for _ in batches]
    cursor = iter(range(len(batches)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            results[index] = engine.run_batch(batches[index])

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return results


def readback_overlap(engine: InferenceEngine, log: ReportLog, images: Sequence[bytes],
                     batch_size: int, batches: int = 8) -> dict[str, Any]:  # fmt: skip
    """Run ``batches`` batches from as many threads as the engine has slots; report whether the
    readback buffers are pinned and contiguous, and how often a batch's forward pass was queued
    before the previous batch's results had reached the host."""
    scores, indices = engine.slots[0].readback(batch_size, 5)
    log.reports.clear()
    _run_concurrently(engine, _batches(engine, images, batch_size, batches),
                      engine.max_inflight_batches)  # fmt: skip
    reports = sorted(log.reports, key=lambda report: report.forward_queued_at)
    overlaps = [
        later.forward_queued_at < earlier.completed_at
        for earlier, later in itertools.pairwise(reports)
    ]
    leads_ms = [
        (earlier.completed_at - later.forward_queued_at) * 1000
        for earlier, later in itertools.pairwise(reports)
    ]
    return {
        "readback_pinned": bool(scores.is_pinned() and indices.is_pinned()),
        "readback_contiguous": bool(scores.is_contiguous() and indices.is_contiguous()),
        "batches": len(reports),
        "overlapping_pairs": sum(overlaps),
        "pairs": len(overlaps),
        "median_lead_ms": sorted(leads_ms)[len(leads_ms) // 2] if leads_ms else float("nan"),
        "mean_busy_ms": sum(r.busy_s for r in reports) * 1000 / max(1, len(reports)),
    }


def concurrent_agreement(engine: InferenceEngine, images: Sequence[bytes], batch_size: int,
                         batches: int = 12) -> dict[str, Any]:  # fmt: skip
    """The same batches run one at a time and then from several threads at once must give the
    same answers: a tensor freed too early and overwritten by another batch would show here."""
    work = _batches(engine, images, batch_size, batches)
    alone = [engine.run_batch(batch) for batch in work]
    together = _run_concurrently(engine, work, max(2, engine.max_inflight_batches))
    compared, same_top1, worst = 0, 0, 0.0
    for first, second in zip(alone, together, strict=True):
        for a, b in zip(first, second, strict=True):
            if isinstance(a, BaseException) or isinstance(b, BaseException):
                raise RuntimeError(f"a batch failed: {a!r} / {b!r}")
            compared += 1
            same_top1 += a.classes[0]["index"] == b.classes[0]["index"]
            worst = max(worst, abs(a.classes[0]["score"] - b.classes[0]["score"]))
    return {"images": compared, "same_top1": same_top1, "max_top1_score_difference": worst}


def padding_cost(engine: InferenceEngine, size: int, repeats: int = 20) -> dict[str, Any]:
    """Forward time of ``size`` rows as they are, and padded to their bucket."""
    backend = engine.backend
    bucket = bucket_for(size, engine.buckets)
    layout = torch.channels_last if backend.channels_last else torch.contiguous_format

    def timed(rows: int) -> float:
        batch = torch.randn(rows, *engine.input_shape, device=engine.device)
        batch = batch.to(backend.input_dtype).contiguous(memory_format=layout)
        samples = []
        with torch.inference_mode():
            for _ in range(repeats + 3):
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                started = time.perf_counter()
                backend.forward(batch)
                if engine.device.type == "cuda":
                    torch.cuda.synchronize(engine.device)
                samples.append(time.perf_counter() - started)
        return sorted(samples[3:])[len(samples[3:]) // 2]

    exact, padded = timed(size), timed(bucket)
    return {"rows": size, "bucket": bucket, "exact_ms": exact * 1000,
            "padded_ms": padded * 1000, "padded_over_exact": padded / exact}  # fmt: skip

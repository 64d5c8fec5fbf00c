"""Choose between precisions by measuring them, not by reading CPU flags."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from app.engine.backends import Backend
from app.engine.errors import CheckFailedError

logger = logging.getLogger("batchserve")

# A less precise candidate must be at least this much faster to be served instead.
MARGIN = 1.1
SECONDS = 0.3  # each candidate precision's forward pass is timed this long at least
# A batch that takes this long is timed once after its warm-up: the first runs' noise is a
# small part of it, and three runs would add minutes to a large detector's start on a CPU.
LONG_PASS_SECONDS = 1.0


def images_per_second(
    backend: Backend, input_shape: tuple[int, int, int], rows: int, min_seconds: float = 0.3
) -> float:
    """The backend's forward rate on a random batch: after one warm-up run, the best of the
    runs of at least ``min_seconds`` (and at least three, or one of a long pass). A span
    rather than a few runs, because torch's own threads keep spinning for a while after any
    torch operation (making the batch is one) and would slow the first runs of another runtime
    on the same cores."""
    layout = torch.channels_last if backend.channels_last else torch.contiguous_format
    batch = torch.randn((rows, *input_shape), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device=backend.device, dtype=backend.input_dtype)
    batch = batch.contiguous(memory_format=layout)
    best = float("inf")
    with torch.inference_mode():
        backend.forward(batch)
        _synchronize(backend)
        began, runs = time.perf_counter(), 0
        while runs < (1 if best > LONG_PASS_SECONDS else 3) or (
            time.perf_counter() - began < min_seconds
        ):
            started = time.perf_counter()
            backend.forward(batch)
            _synchronize(backend)
            best = min(best, time.perf_counter() - started)
            runs += 1
    return rows / best


def _synchronize(backend: Backend) -> None:
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)


Rate = Callable[[Backend, tuple[int, int, int], int, float], float]


def side_by_side(
    first: Backend,
    second: Backend,
    input_shape: tuple[int, int, int],
    rows: int,
    rounds: int = 3,
    rate: Rate = images_per_second,
) -> tuple[float, float]:
    """Both backends' forward rates, measured in turn ``rounds`` times, the best of each: the
    machine's other work only ever slows a measurement down, so the best is the least
    disturbed, and measuring in turn lets a change in load touch both alike."""
    rates: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for backend, measured in zip((first, second), rates, strict=True):
            measured.append(rate(backend, input_shape, rows, 0.3))
    return max(rates[0]), max(rates[1])


def fastest(
    candidates: Sequence[str],
    build: Callable[[str], Backend],
    input_shape: tuple[int, int, int],
    rows: int,
    failures_of: Callable[[Backend], list[str]] | None = None,
    rate: Rate = images_per_second,
) -> tuple[Backend, dict[str, float]]:
    """Build a backend per candidate precision (``fp32``, ``bf16``, ...: most accurate first)
    and serve the first one that no later candidate beats by ``MARGIN``, unless it fails its
    start-up check (``failures_of``): then the next one by the same rule. Returns it and the
    measured images/s per precision; ``backend.rejected_precisions`` names those that failed."""
    if len(candidates) == 1:
        return build(candidates[0]), {}
    rates: dict[str, float] = {}
    built: dict[str, Backend] = {}
    rejected: dict[str, list[str]] = {}

    def measured(precision: str) -> list[str]:
        built[precision] = build(precision)
        rates[precision] = rate(built[precision], input_shape, rows, SECONDS)
        return []

    def checked(backend: Backend) -> list[str]:
        return failures_of(backend) if failures_of is not None else []

    for precision in candidates:
        if not_run := _guarded(precision, candidates[0], partial(measured, precision)):
            built.pop(precision, None)
            rejected[precision] = not_run
    for precision in preferred(rates):
        backend = built.pop(precision)
        failed = _guarded(precision, candidates[0], partial(checked, backend))
        if failed:
            logger.warning("precision auto: %s failed its start-up check, trying the next: %s",
                           precision, "; ".join(failed))  # fmt: skip
            rejected[precision] = failed
            continue
        logger.info(
            "precision auto: %s (measured %s images/s at batch %d)", precision,
            ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items()), rows,
        )  # fmt: skip
        backend.rejected_precisions = rejected or None
        return backend, rates
    raise CheckFailedError(
        "every precision failed its start-up check: "
        + "; ".join(f"{name}: {' '.join(failed)}" for name, failed in rejected.items())
    )


def _guarded(precision: str, most_accurate: str, work: Callable[[], list[str]]) -> list[str]:
    """What ``work()`` finds wrong with a candidate; where a less precise one raises (a module
    that makes float32 tensors of its own, as torchvision's detectors do, cannot run converted
    to bf16), that it does not run, and the next candidate is weighed. The most accurate
    one's error is the model's own: raised."""
    try:
        return work()
    except Exception as exc:
        if precision == most_accurate:
            raise
        logger.warning("precision auto: %s does not run this model: %s", precision, exc)
        return [f"does not run this model: {exc}"]


def preferred(rates: dict[str, float]) -> list[str]:
    """Precisions (most accurate first, as measured) in the order they are served: each time
    the first one that no later one beats by ``MARGIN``."""
    left, order = dict(rates), []
    while left:
        best = next(iter(left))
        for precision, rate in left.items():
            if rate > left[best] * MARGIN:
                best = precision
        order.append(best)
        del left[best]
    return order

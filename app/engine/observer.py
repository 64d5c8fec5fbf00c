"""How the engine reports what each batch did, without knowing who listens."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BatchReport:
    """One executed batch, timed on the device's own clock (CUDA events on a GPU).

    ``stages``: seconds per stage of this batch: ``device_decode`` (JPEGs decoded on the
    device), ``h2d`` (host-to-device copies), ``collate`` (normalise into the input batch),
    ``forward``, ``postprocess`` (softmax and top-k), ``d2h`` (the copy back); those that did
    not happen are absent.

    ``preprocess_s`` is device time spent preparing the inputs (decode on the device, copies,
    normalisation); ``busy_s`` is device time from the start of the forward pass to the end
    of the readback. On a GPU the two overlap across batches (batch N+1 is prepared on its own
    stream while batch N computes), so they are reported apart rather than summed.

    ``forward_queued_at`` and ``completed_at`` are host ``time.perf_counter()`` readings: when
    the forward pass was handed to the device, and when the results were ready on the host.

    ``canvas``: the input's ``(height, width)``, the shape every image of the batch shares.
    """

    rows: int
    padded_rows: int
    preprocess_s: float
    busy_s: float
    forward_queued_at: float
    completed_at: float
    stages: dict[str, float] = field(default_factory=dict)
    canvas: tuple[int, int] = (0, 0)


class EngineObserver:
    """Receives engine events. Subclass and override what you need; every hook is a no-op.

    Hooks run on the batch's worker thread, after its results are ready: keep them cheap.
    """

    def on_batch(self, report: BatchReport) -> None:
        """A batch finished (warm-up batches are not reported)."""

    def on_decode_fallbacks(self, count: int) -> None:
        """``count`` images of a batch were decoded on the CPU because the device's JPEG
        decoder failed them (or failed altogether)."""

"""Learned execution time per batch size, for the latency-SLO-aware window."""

from __future__ import annotations


class ExecutionTimeModel:
    """An exponentially weighted mean of execution time per batch size.

    Sizes never seen are estimated by a least-squares line ``a*n + b`` through the sizes seen,
    so a handful of warm-up timings is enough to answer for every size.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self._smoothing = smoothing
        self._mean: dict[int, float] = {}
        self._line: tuple[float, float] | None = None

    def observe(self, batch_size: int, seconds: float) -> None:
        previous = self._mean.get(batch_size)
        if previous is None:
            self._mean[batch_size] = seconds
        else:
            self._mean[batch_size] = previous + self._smoothing * (seconds - previous)
        self._line = None

    def estimate(self, batch_size: int) -> float | None:
        """Expected seconds for a batch of this size, or None before any observation."""
        known = self._mean.get(batch_size)
        if known is not None:
            return known
        if not self._mean:
            return None
        if self._line is None:
            self._line = self._fit()
        slope, intercept = self._line
        return max(0.0, slope * batch_size + intercept)

    def _fit(self) -> tuple[float, float]:
        sizes = list(self._mean)
        if len(sizes) == 1:
            # One point: assume time proportional to size, the safe side for larger batches.
            only = sizes[0]
            return self._mean[only] / only, 0.0
        count = len(sizes)
        mean_n = sum(sizes) / count
        mean_t = sum(self._mean.values()) / count
        var = sum((n - mean_n) ** 2 for n in sizes)
        cov = sum((n - mean_n) * (self._mean[n] - mean_t) for n in sizes)
        slope = cov / var
        return slope, mean_t - slope * mean_n

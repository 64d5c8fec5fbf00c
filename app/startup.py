"""How long start-up took, phase by phase, counted from the process's own start.

``imports`` runs from the moment the process was created (the interpreter, uvicorn and the
application's imports: torch above all) to ``create_app``; each model adds its own phases as
it loads (``weights``, ``artefacts``, ``compile``, ``choice``, ``check``, ``warmup``,
``batcher``); ``server`` covers what the lifespan does around them, and ``ready`` is the
process's age when ``/readyz`` turned 200. Shown in ``/v1/models`` and as
``batchserve_startup_seconds{phase}``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The phases of one model's load, in the order they run.
MODEL_PHASES = ("weights", "artefacts", "choice", "compile", "check", "warmup", "batcher")


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux ``/proc``), or None elsewhere."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
    except OSError:
        return None
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks
    return max(0.0, now - started)


class Phases:
    """Seconds per phase; a phase entered twice adds up, and a phase entered inside another
    counts as its own, not also as the outer one's (a check run while choosing a precision)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open phase: what its inner phases took

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            self.add(name, spent - self._inner.pop())
            if self._inner:
                self._inner[-1] += spent

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def merge(self, other: Phases) -> None:
        for name, seconds in other.seconds.items():
            self.add(name, seconds)

    def rounded(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}

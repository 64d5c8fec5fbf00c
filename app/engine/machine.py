"""What the engine asks of the machine it runs on: whether the CPU has native bf16 kernels,
and how fast a backend runs a batch. Both decide which precision and which backend serve; a
test (or a tool that knows better) hands the factory its own answers instead of the
measurements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.engine.backends import Backend
from app.engine.checks.precision import images_per_second
from app.engine.device import cpu_supports_bf16

# A backend's forward rate in images/s: (backend, input shape, rows, seconds to time at least).
Rate = Callable[[Backend, tuple[int, int, int], int, float], float]


@dataclass(frozen=True)
class Machine:
    native_bf16: bool  # oneDNN's native bf16 kernels (AVX512-BF16 or AMX)
    rate: Rate = images_per_second

    @classmethod
    def here(cls) -> Machine:
        """This machine, as it answers."""
        return cls(native_bf16=cpu_supports_bf16())


def fixed_rates(rates: Callable[[Backend], float], native_bf16: bool = False) -> Machine:
    """A machine whose backends run at ``rates(backend)`` images/s, every time."""
    return Machine(native_bf16, lambda backend, shape, rows, seconds: rates(backend))

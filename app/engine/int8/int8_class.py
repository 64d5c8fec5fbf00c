"""Which INT8 arithmetic this CPU has: it decides how a model must be quantized to keep its
accuracy.

x86 runtimes (ONNX Runtime's MLAS, OpenVINO's oneDNN) multiply unsigned 8-bit activations by
signed 8-bit weights. Without VNNI they do it with ``vpmaddubsw``, which adds each pair of
products into a *saturating* 16-bit intermediate: with full 8-bit weights a pair can reach
2 x 255 x 127 = 64770 and is clamped to 32767, so the model computes something else. Both
runtimes document it (ONNX Runtime: ``reduce_range``; NNCF: ``OverflowFix``); the cure is
7-bit weights. VNNI (``vpdpbusd``, AVX512-VNNI or AVX-VNNI) and AMX accumulate in 32 bits and
keep full 8-bit weights exact. Arm's kernels widen to 16-bit products and add into 32 bits,
with or without the dot-product instructions, so they do not saturate either.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Int8Class:
    """A CPU's INT8 class: its name (``amx``, ``avx512-vnni``, ``avx-vnni``, ``avx512``,
    ``avx2``, ``x86``, ``arm-i8mm``, ``arm-dotprod``, ``arm``, ``unknown``) and whether its
    u8 x s8 products saturate (then weights must be quantized to 7 bits)."""

    name: str
    saturates: bool

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "weights": "7-bit (saturating u8 x s8 without VNNI)" if self.saturates else "8-bit",
        }


# In order: the first class whose flag the CPU has is its class.
_X86 = (
    ("amx_int8", "amx", False),
    ("avx512_vnni", "avx512-vnni", False),
    ("avx_vnni", "avx-vnni", False),
    ("avx512bw", "avx512", True),
    ("avx2", "avx2", True),
)
_ARM = (("i8mm", "arm-i8mm"), ("asimddp", "arm-dotprod"))


# Every class, and whether it saturates.
CLASSES = {name: saturates for _, name, saturates in _X86} | {
    "x86": True,
    **{name: False for _, name in _ARM},
    "arm": False,
    "unknown": True,
}


def named(name: str) -> Int8Class:
    """The class of this name (``KeyError`` if there is none)."""
    return Int8Class(name, CLASSES[name])


def classify(flags: Iterable[str], machine: str) -> Int8Class:
    """The INT8 class of a CPU with these ``/proc/cpuinfo`` flags (x86 ``flags``, Arm
    ``Features``) and this ``platform.machine()``."""
    present = set(flags)
    arch = machine.lower()
    if arch in ("x86_64", "amd64", "i386", "i686"):
        for flag, name, saturates in _X86:
            if flag in present:
                return Int8Class(name, saturates)
        return Int8Class("x86", True)  # SSSE3's pmaddubsw saturates the same way
    if arch in ("aarch64", "arm64") or arch.startswith("arm"):
        for flag, name in _ARM:
            if flag in present:
                return Int8Class(name, False)
        return Int8Class("arm", False)
    # Unknown: assume the worst, so that a model built here keeps its accuracy on x86 too.
    return Int8Class("unknown", True)


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in a ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


@functools.cache
def this_cpu() -> Int8Class:
    """This machine's INT8 class (read once)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    return classify(cpu_flags(text), platform.machine())

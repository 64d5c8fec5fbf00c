"""Turn the eager model into something faster to run, and prove it still gives the same answers.

- ``torchscript``: trace and freeze. Batch-norm is folded into the convolutions, and the whole
  forward pass runs in C++ without taking the GIL once per operator, which matters in a server
  where the event loop and decode threads want the GIL too. Compiles in about a second.
- ``inductor``: ``torch.compile`` with freezing. Faster kernels still, but each batch size is
  compiled on first use (tens of seconds on a CPU) and a C++ compiler must be installed.
- ``none``: eager PyTorch.

Whatever the mode, the result is checked against the eager model on a probe batch; a model
that cannot be traced or that disagrees falls back to eager, with a warning.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch
from torch import nn

logger = logging.getLogger("batchserve")

CompileMode = Literal["auto", "none", "torchscript", "inductor"]

# How far the optimized model's logits may drift from eager ones, relative to their scale:
# folding batch-norm reorders floating-point work, which shows most in low precision.
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def resolve_compile(mode: CompileMode, device: torch.device) -> str:
    """``auto``: TorchScript on a CPU, where the GIL-free forward pays most; eager on CUDA,
    where CUDA graphs remove the per-operator overhead instead."""
    if mode == "auto":
        return "torchscript" if device.type == "cpu" else "none"
    return mode


def optimize(model: nn.Module, mode: str, probe: torch.Tensor) -> tuple[nn.Module, str]:
    """Return the model to serve and the mode actually used."""
    if mode == "none":
        return model, "none"
    try:
        with torch.inference_mode():
            reference = model(probe).float()
            optimized = _build(model, mode, probe)
            candidate = optimized(probe).float()
    except Exception as exc:
        logger.warning("could not compile the model with %s (%s); serving it eagerly", mode, exc)
        return model, "none"
    scale = reference.abs().max().clamp_min(1e-6)
    drift = float((candidate - reference).abs().max() / scale)
    tolerance = _TOLERANCE.get(probe.dtype, 1e-3)
    if not torch.isfinite(candidate).all() or drift > tolerance:
        logger.warning(
            "the %s model differs from the eager one (relative drift %.2g > %.2g); "
            "serving it eagerly",
            mode, drift, tolerance,
        )  # fmt: skip
        return model, "none"
    logger.info("compiled the model with %s (relative drift %.2g)", mode, drift)
    return optimized, mode


def _build(model: nn.Module, mode: str, probe: torch.Tensor) -> nn.Module:
    if mode == "torchscript":
        with warnings.catch_warnings():
            # TorchScript is in maintenance in PyTorch 2.x (it says so); it still serves well.
            # Tracer warnings are moot: the result is checked against eager below.
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(model, probe, check_trace=False)  # type: ignore[no-untyped-call]
            frozen: nn.Module = torch.jit.freeze(traced.eval())
        return frozen
    if mode == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # fold weights and batch-norm into the kernels
        compiled: nn.Module = torch.compile(model, dynamic=False)  # type: ignore[assignment]
        return compiled
    raise ValueError(f"unknown compile mode {mode!r}")

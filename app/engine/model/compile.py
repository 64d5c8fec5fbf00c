"""Turn the eager model into something faster to run, and prove it still gives the same answers.

- ``torchscript``: trace and freeze. Batch-norm is folded into the convolutions, and the whole
  forward pass runs in C++ without taking the GIL once per operator, which matters in a server
  where the event loop and decode threads want the GIL too. Compiles in about a second. The
  frozen module is kept as an artefact and what serves is always loaded from it: tracing and
  freezing register types in TorchScript's global compilation unit that are never freed (with
  the frozen weights: about the model's size each time), while a loaded module lives in a
  compilation unit of its own and goes with it. So reloading a model costs no memory, and only
  the first build of each model's weights in a process leaves its trace behind.
- ``inductor``: ``torch.compile`` with freezing. Faster kernels still, but each batch size is
  compiled on first use (tens of seconds on a CPU) and a C++ compiler must be installed.
- ``none``: eager PyTorch.

Whatever the mode, the result is checked against the eager model on a probe batch; a model
that cannot be traced or that disagrees falls back to eager, with a warning. A TorchScript
artefact that passed keeps that verdict beside it, bound to its sha256, the torch version, the
dtype, the device and the code: a later start loads it without building the eager model (``kept``).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from app.engine.model.artifacts import file_sha256, keep_json, read_json

logger = logging.getLogger("batchserve")

VERDICT = "check.json"  # beside a TorchScript artefact: it agreed with the eager model

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


def optimize(
    model: nn.Module, mode: str, probe: torch.Tensor, artifact: Path | None = None
) -> tuple[nn.Module, str]:
    """Return the model to serve and the mode actually used. A TorchScript model is kept at
    ``artifact`` (when given) and loaded from there the next time."""
    if mode == "none":
        return model, "none"
    try:
        with torch.inference_mode():
            reference = model(probe).float()
            cached = _cached(artifact, probe) if mode == "torchscript" else None
            candidate = cached(probe).float() if cached is not None else None
            if (
                cached is not None
                and candidate is not None
                and (_drift(candidate, reference) <= _tolerance(probe))
            ):
                optimized = cached
            else:  # none yet, or made from other code with the same weights: build it again
                optimized = _build(model, mode, probe, artifact)
                candidate = optimized(probe).float()
            drift = _drift(candidate, reference)
    except Exception as exc:
        logger.warning("could not compile the model with %s (%s); serving it eagerly", mode, exc)
        return model, "none"
    tolerance = _tolerance(probe)
    if not torch.isfinite(candidate).all() or drift > tolerance:
        logger.warning(
            "the %s model differs from the eager one (relative drift %.2g > %.2g); "
            "serving it eagerly",
            mode, drift, tolerance,
        )  # fmt: skip
        return model, "none"
    logger.info("compiled the model with %s (relative drift %.2g)", mode, drift)
    if mode == "torchscript" and artifact is not None and artifact.is_file():
        keep_json(artifact.with_name(VERDICT), {
            "bound_to": _binding(artifact, probe.dtype, probe.device),
            "drift": drift, "tolerance": tolerance,
        })  # fmt: skip
    return optimized, mode


def kept(artifact: Path, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """The TorchScript model at ``artifact`` if it passed its check against the eager model
    before (its kept verdict is bound to this very file, torch version, dtype and device)."""
    record = read_json(artifact.with_name(VERDICT))
    if record is None or not artifact.is_file():
        return None
    if not isinstance(record.get("bound_to"), dict):
        logger.warning("ignoring the unreadable verdict beside %s: checking again", artifact)
        return None
    if record["bound_to"] != _binding(artifact, dtype, device):
        return None
    probe = torch.empty(0, device=device, dtype=dtype)
    loaded = _cached(artifact, probe)
    if loaded is not None:
        logger.info("the TorchScript model %s agreed with the eager one before", artifact)
    return loaded


def _binding(artifact: Path, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    from app.engine.model.kept import code_fingerprint

    return {"sha256": file_sha256(artifact), "torch": torch.__version__, "dtype": str(dtype),
            "device": device.type, "code": code_fingerprint()}  # fmt: skip


def _drift(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().clamp_min(1e-6)
    return float((candidate - reference).abs().max() / scale)


def _tolerance(probe: torch.Tensor) -> float:
    return _TOLERANCE.get(probe.dtype, 1e-3)


def _cached(artifact: Path | None, probe: torch.Tensor) -> nn.Module | None:
    if artifact is None or not artifact.is_file():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "deprecated": see above
            loaded: nn.Module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(artifact), map_location=probe.device
            )
    except (RuntimeError, OSError) as exc:
        logger.warning("could not load %s (%s): tracing again", artifact, exc)
        return None
    return loaded


def _build(
    model: nn.Module, mode: str, probe: torch.Tensor, artifact: Path | None = None
) -> nn.Module:
    if mode == "torchscript":
        with warnings.catch_warnings():
            # TorchScript is in maintenance in PyTorch 2.x (it says so); it still serves well.
            # Tracer warnings are moot: the result is checked against eager below.
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(model, probe, check_trace=False)  # type: ignore[no-untyped-call]
            frozen: nn.Module = torch.jit.freeze(traced.eval())
        if artifact is None:
            return frozen
        artifact.parent.mkdir(parents=True, exist_ok=True)
        partial = artifact.with_name(f".{artifact.name}.{os.getpid()}.partial")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.jit.save(frozen, str(partial))
        partial.replace(artifact)  # in one step: no reader sees half a file
        loaded = _cached(artifact, probe)
        return loaded if loaded is not None else frozen
    if mode == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # fold weights and batch-norm into the kernels
        compiled: nn.Module = torch.compile(model, dynamic=False)  # type: ignore[assignment]
        return compiled
    raise ValueError(f"unknown compile mode {mode!r}")

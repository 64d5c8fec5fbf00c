"""``BACKEND=auto``: serve the fastest installed backend, measured once per CPU, model and
versions.

On a CPU the fastest of PyTorch, ONNX Runtime and OpenVINO depends on the CPU, the model and
the runtimes' versions (see the backends benchmark), so a user who names none would otherwise
get whichever we guessed. At the first start every installed backend is built (exporting its
artefact if needed) and its forward pass timed at the warm-up batch size; the fastest that
passes its start-up check (like any runtime's) is served, and those that failed theirs are
named in the decision. The decision is kept beside the artefacts,
keyed by what it depends on, so that later starts build only the chosen backend. On a GPU the
PyTorch backend (CUDA graphs, fp16, device decoding) stays the choice.

INT8 joins the candidates only through its accuracy gate: with ``PRECISION=auto``, the INT8
model of a runtime competes when one was built (``python -m app.quantize``) and its gate
passes here; with ``PRECISION=int8`` only the INT8 runtimes compete (built at start-up from
``CALIBRATION_DIR`` when it is set). An ungated INT8 model is never chosen automatically.
"""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.cpus import cpu_model
from app.engine.artifacts import keep_json, read_json
from app.engine.backends import Backend
from app.engine.device import cpu_supports_bf16
from app.engine.errors import StartupError
from app.engine.int8_class import this_cpu
from app.engine.precision import images_per_second
from app.settings import Settings

logger = logging.getLogger("batchserve")

# The backends ``auto`` may choose on a CPU (each its runtime's module and distribution), in
# the order that breaks a tie.
CANDIDATES = ("torch", "onnxruntime", "openvino")
INT8_RUNTIMES = ("onnxruntime", "openvino")
FOLDER = "backend-choice"


def label(backend: str, precision: str) -> str:
    """A candidate's name in the rates: ``openvino``, or ``openvino int8`` for its INT8 model."""
    return f"{backend} int8" if precision == "int8" else backend


def candidates(precision: str, int8_ready: list[str]) -> list[tuple[str, str]]:
    """(backend, precision) pairs to measure: the installed backends in ``precision``, and
    the INT8 models of ``int8_ready`` (runtimes whose gated INT8 model passes here)."""
    if precision == "int8":
        return [(name, "int8") for name in installed() if name in INT8_RUNTIMES]
    pairs = [(name, precision) for name in installed()]
    if precision == "auto":
        pairs += [(name, "int8") for name in int8_ready]
    return pairs


def installed() -> list[str]:
    """The backends whose runtime can be imported here."""
    return [name for name in CANDIDATES if importlib.util.find_spec(name)]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def decision_path(settings: Settings, model_digest: str, rows: int, int8_ready: list[str]) -> Path:
    """Where the choice for this model, its settings, this CPU, these versions and these INT8
    models is kept."""
    key = {
        "model": settings.model, "weights": model_digest, "precision": settings.precision,
        "compile": settings.compile, "rows": rows, "threads": settings.intra_op_threads,
        "image_size": settings.image_size, "cpu": cpu_model(), "int8_class": this_cpu().name,
        # Native bf16 kernels add bf16 candidates (PyTorch's and OpenVINO's) to PRECISION=auto.
        "native_bf16": cpu_supports_bf16(),
        "versions": {name: _version(name) for name in CANDIDATES},
        "candidates": installed(), "int8_ready": sorted(int8_ready),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return settings.artifacts_dir / FOLDER / f"{digest}.json"


def choose_backend(
    settings: Settings,
    device: torch.device,
    model_digest: str,
    input_shape: tuple[int, int, int],
    rows: int,
    build: Callable[[str, str], Backend],
    int8_ready: Callable[[str], bool],
    failures: Callable[[Backend], list[str]],
) -> tuple[Backend, dict[str, Any]]:
    """The backend to serve and why: ``build(name, precision)`` makes one (with its
    artefact); ``int8_ready(name)`` says whether that runtime's INT8 model exists and passes
    its gate here (without building one); ``failures(backend)`` runs its start-up check. The
    fastest candidate that passes its check is served."""
    if device.type == "cuda":
        return build("torch", settings.precision), {
            "chosen": "torch", "precision": settings.precision,
            "reason": "on a GPU, PyTorch is the design",
        }  # fmt: skip
    ready = (
        [name for name in installed() if name in INT8_RUNTIMES and int8_ready(name)]
        if settings.precision == "auto" else []
    )  # fmt: skip
    path = decision_path(settings, model_digest, rows, ready)
    kept = read_json(path)
    if kept is not None and kept.get("chosen") in installed():
        chosen, precision = str(kept["chosen"]), str(kept.get("precision", settings.precision))
        logger.info("backend auto: %s, measured before (%s)", label(chosen, precision),
                    _rates(kept["rates"]))  # fmt: skip
        return build(chosen, precision), {**kept, "reused": True}
    best: Backend | None = None
    best_label = ""
    rates: dict[str, float] = {}
    pairs: dict[str, tuple[str, str]] = {}
    for name, precision in candidates(settings.precision, ready):
        try:
            backend = build(name, precision)
        except StartupError as exc:  # a runtime that cannot serve this model is no candidate
            logger.warning("backend auto: %s cannot serve this model: %s",
                           label(name, precision), exc)  # fmt: skip
            continue
        key = label(name, precision)
        pairs[key] = (name, precision)
        rates[key] = images_per_second(backend, input_shape, rows)
        if best is None or rates[key] > rates[best_label]:
            best, best_label = backend, key  # the one it beats goes: one model besides the best
        del backend
        gc.collect()
    if best is None:
        raise StartupError(
            f"BACKEND=auto: no installed backend can serve this model in "
            f"PRECISION={settings.precision}"
        )
    served, rejected = _first_that_passes(best, best_label, rates, pairs, build, failures)
    decision: dict[str, Any] = {
        "chosen": served.name,
        # What it serves, not what was asked (PRECISION=auto): a later start builds only that
        # precision instead of measuring fp32 against bf16 again.
        "precision": served.precision,
        "rates": rates,
        "precision_rates": served.measured_rates,
        "rows": rows,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "reason": "the fastest forward pass measured here"
        + (" that passed its start-up check" if rejected else ""),
    }
    if rejected:
        decision["rejected"] = rejected
    keep_json(path, decision)
    logger.info("backend auto: %s (measured %s images/s at batch %d)",
                label(served.name, served.precision), _rates(rates), rows)  # fmt: skip
    return served, decision


def _first_that_passes(
    best: Backend,
    best_label: str,
    rates: dict[str, float],
    pairs: dict[str, tuple[str, str]],
    build: Callable[[str, str], Backend],
    failures: Callable[[Backend], list[str]],
) -> tuple[Backend, dict[str, list[str]]]:
    """The fastest candidate whose start-up check passes (the fastest is already built; the
    others are built again, one at a time), and the failures of those that did not."""
    rejected: dict[str, list[str]] = {}
    kept: Backend | None = best
    for key in sorted(rates, key=rates.__getitem__, reverse=True):
        backend = kept if key == best_label and kept is not None else build(*pairs[key])
        kept = None  # one model at a time
        failed = failures(backend)
        if not failed:
            return backend, rejected
        logger.warning("backend auto: %s failed its start-up check, trying the next: %s",
                       key, "; ".join(failed))  # fmt: skip
        rejected[key] = failed
        del backend
        gc.collect()
    raise StartupError(
        "BACKEND=auto: every candidate failed its start-up check: "
        + "; ".join(f"{key}: {' '.join(failed)}" for key, failed in rejected.items())
    )


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())

"""``BACKEND=auto``: serve the fastest installed backend, measured once per CPU, model and
versions.

On a CPU the fastest of PyTorch, ONNX Runtime and OpenVINO depends on the CPU, the model and
the runtimes' versions (see the backends benchmark), so a user who names none would otherwise
get whichever we guessed. At the first start every installed backend is built (exporting its
artefact if needed) and its forward pass timed at the warm-up batch size; the fastest is
served, after its start-up check like any runtime. The decision is kept beside the artefacts,
keyed by what it depends on, so that later starts build only the chosen backend. On a GPU the
PyTorch backend (CUDA graphs, fp16, device decoding) stays the choice.
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
from app.engine.artifacts import read_json, write_json
from app.engine.backends import Backend
from app.engine.errors import StartupError
from app.engine.int8_class import this_cpu
from app.engine.precision import images_per_second
from app.settings import Settings

logger = logging.getLogger("batchserve")

# The backends ``auto`` may choose on a CPU (each its runtime's module and distribution), in
# the order that breaks a tie.
CANDIDATES = ("torch", "onnxruntime", "openvino")
FOLDER = "backend-choice"


def installed() -> list[str]:
    """The backends whose runtime can be imported here."""
    return [name for name in CANDIDATES if importlib.util.find_spec(name)]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def decision_path(settings: Settings, model_digest: str, rows: int) -> Path:
    """Where the choice for this model, its settings, this CPU and these versions is kept."""
    key = {
        "model": settings.model, "weights": model_digest, "precision": settings.precision,
        "compile": settings.compile, "rows": rows, "threads": settings.intra_op_threads,
        "image_size": settings.image_size, "cpu": cpu_model(), "int8_class": this_cpu().name,
        "versions": {name: _version(name) for name in CANDIDATES},
        "candidates": installed(),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return settings.artifacts_dir / FOLDER / f"{digest}.json"


def choose_backend(
    settings: Settings,
    device: torch.device,
    model_digest: str,
    input_shape: tuple[int, int, int],
    rows: int,
    build: Callable[[str], Backend],
) -> tuple[Backend, dict[str, Any]]:
    """The backend to serve and why: ``build(name)`` makes one (with its artefact)."""
    if device.type == "cuda":
        return build("torch"), {"chosen": "torch", "reason": "on a GPU, PyTorch is the design"}
    if settings.precision == "int8":
        raise StartupError(
            "BACKEND=auto does not choose an INT8 runtime: name BACKEND=onnxruntime or "
            "BACKEND=openvino with PRECISION=int8"
        )
    path = decision_path(settings, model_digest, rows)
    kept = read_json(path)
    if kept is not None and kept.get("chosen") in installed():
        chosen = str(kept["chosen"])
        logger.info("backend auto: %s, measured before (%s)", chosen, _rates(kept["rates"]))
        return build(chosen), {**kept, "reused": True}
    best: Backend | None = None
    rates: dict[str, float] = {}
    for name in installed():
        try:
            backend = build(name)
        except StartupError as exc:  # a runtime that cannot serve this model is no candidate
            logger.warning("backend auto: %s cannot serve this model: %s", name, exc)
            continue
        rates[name] = images_per_second(backend, input_shape, rows)
        if best is None or rates[name] > rates[best.name]:
            best = backend  # the one it beats goes: one model in memory besides the best
        del backend
        gc.collect()
    if best is None:
        raise StartupError("BACKEND=auto: no installed backend can serve this model")
    decision = {
        "chosen": best.name,
        "rates": rates,
        "rows": rows,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "reason": "the fastest forward pass measured here",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, decision)
    logger.info("backend auto: %s (measured %s images/s at batch %d)", best.name,
                _rates(rates), rows)  # fmt: skip
    return best, decision


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())

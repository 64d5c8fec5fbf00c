"""``BACKEND=auto``: serve the fastest installed backend, measured once per CPU, model, code
and versions, and only where the measurement can tell.

On a CPU the fastest of PyTorch, ONNX Runtime and OpenVINO depends on the CPU, the model and
the runtimes' versions (see the backends benchmark), so a user who names none would otherwise
get whichever we guessed. At the first start every installed backend is built (exporting its
artefact if needed), and their forward passes are timed in alternating rounds, each round
under the device's lock (no other model's batch runs meanwhile) and in a new order, so that a
change in the machine's load touches every candidate alike. A candidate wins only when its
margin over each other one exceeds the noise the rounds measured (half the spread of its
per-round ratios); when it does not, the simplest candidate within the noise is served
(PyTorch before ONNX Runtime before OpenVINO, fp32 before INT8), the decision says so, and it
is not kept: the next start measures again. A winner that passes its start-up check is kept
beside the artefacts, keyed by what it depends on, so that later starts build only it; a kept
decision that does not read back as one is measured again. On a GPU the PyTorch backend (CUDA
graphs, fp16, device decoding) stays the choice.

INT8 joins the candidates only through its accuracy gate: with ``PRECISION=auto``, the INT8
model of a runtime competes when one was built (``python -m app.quantize``) and its gate
passes here; with ``PRECISION=int8`` only the INT8 runtimes compete (built at start-up from
``CALIBRATION_DIR`` when it is set). An ungated INT8 model is never chosen automatically.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import statistics
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from app.cpus import cpu_model
from app.engine.backends import Backend
from app.engine.checks.precision import LONG_PASS_SECONDS
from app.engine.errors import StartupError
from app.engine.int8.int8_class import this_cpu
from app.engine.machine import Machine
from app.engine.model.artifacts import keep_json, read_json
from app.engine.model.kept import code_fingerprint, read_kept
from app.model_config import ModelConfig

logger = logging.getLogger("batchserve")

# The backends ``auto`` may choose on a CPU (each its runtime's module and distribution), in
# the order that breaks a tie.
CANDIDATES = ("torch", "onnxruntime", "openvino")
INT8_RUNTIMES = ("onnxruntime", "openvino")
FOLDER = "backend-choice"
# Rounds of timing, each candidate once per round, and how long each timing lasts at least.
ROUNDS = 5
ROUND_SECONDS = 0.15
# Fewer rounds where the first finds a batch that takes seconds: a large model's noise is a
# small part of each pass, and five rounds of it would keep a CPU's start-up for minutes.
LONG_ROUNDS = 3


class Decision(BaseModel):
    """A kept decision, as it must read back."""

    chosen: str
    precision: str
    rates: dict[str, float]


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


def runtime_versions() -> dict[str, str]:
    """The installed version of every candidate backend's distribution."""
    return {name: _version(name) for name in CANDIDATES}


def decision_path(
    config: ModelConfig, model_digest: str, rows: int, int8_ready: list[str], native_bf16: bool
) -> Path:
    """Where the choice for this model, its config, this CPU, these versions and these INT8
    models is kept."""
    key = {
        "model": config.model, "weights": model_digest, "precision": config.precision,
        "compile": config.compile, "rows": rows, "threads": config.threads,
        "image_size": config.image_size, "cpu": cpu_model(), "int8_class": this_cpu().name,
        # Native bf16 kernels add bf16 candidates (PyTorch's and OpenVINO's) to PRECISION=auto.
        "native_bf16": native_bf16,
        "versions": runtime_versions(),
        "candidates": installed(), "int8_ready": sorted(int8_ready), "code": code_fingerprint(),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return config.artifacts_dir / FOLDER / f"{digest}.json"


def choose_backend(
    config: ModelConfig,
    device: torch.device,
    model_digest: str,
    input_shape: tuple[int, int, int],
    rows: int,
    build: Callable[[str, str], Backend],
    int8_ready: Callable[[str], bool],
    failures: Callable[[Backend], list[str]],
    device_lock: threading.Lock | None = None,
    machine: Machine | None = None,
) -> tuple[Backend, dict[str, Any]]:
    """The backend to serve and why: ``build(name, precision)`` makes one (with its
    artefact); ``int8_ready(name)`` says whether that runtime's INT8 model exists and passes
    its gate here (without building one); ``failures(backend)`` runs its start-up check;
    ``device_lock`` is held while a candidate is timed (at ``machine.rate``). The fastest
    candidate that passes its check is served, if the rounds can tell it is the fastest."""
    machine = machine or Machine.here()
    if device.type == "cuda":
        return build("torch", config.precision), {
            "chosen": "torch", "precision": config.precision,
            "reason": "on a GPU, PyTorch is the design",
        }  # fmt: skip
    ready = (
        [name for name in installed() if name in INT8_RUNTIMES and int8_ready(name)]
        if config.precision == "auto" else []
    )  # fmt: skip
    path = decision_path(config, model_digest, rows, ready, machine.native_bf16)
    kept = read_kept(path, Decision, "backend choice")
    if kept is not None and kept.chosen in installed():
        logger.info("backend auto: %s, measured before (%s)", label(kept.chosen, kept.precision),
                    _rates(kept.rates))  # fmt: skip
        record = read_json(path) or {}
        return build(kept.chosen, kept.precision), {**record, "reused": True}
    built: dict[str, Backend] = {}
    for name, precision in candidates(config.precision, ready):
        try:
            built[label(name, precision)] = build(name, precision)
        except StartupError as exc:  # a runtime that cannot serve this model is no candidate
            logger.warning("backend auto: %s cannot serve this model: %s",
                           label(name, precision), exc)  # fmt: skip
    if not built:
        raise StartupError(
            f"BACKEND=auto: no installed backend can serve this model in "
            f"PRECISION={config.precision}"
        )
    rounds = measure_in_rounds(built, input_shape, rows, device_lock, machine=machine)
    rates = {key: statistics.median(measured) for key, measured in rounds.items()}
    order, within = preference(rounds)
    served, rejected = _first_that_passes(order, built, failures)
    decision: dict[str, Any] = {
        "chosen": served.name,
        # What it serves, not what was asked (PRECISION=auto): a later start builds only that
        # precision instead of measuring fp32 against bf16 again.
        "precision": served.precision,
        "rates": rates,
        "rounds": rounds,
        "precision_rates": served.measured_rates,
        "rows": rows,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    served_key = label(served.name, served.precision)
    if within:
        decision["reason"] = (
            f"{', '.join(within)} measured within the noise of one another: serving "
            f"{served_key}, the simplest that passed its start-up check; not kept, the next "
            f"start measures again"
        )
    else:
        decision["reason"] = "the fastest forward pass measured here, beyond the noise" + (
            " among those that passed their start-up check" if rejected else ""
        )
        keep_json(path, decision)
    if rejected:
        decision["rejected"] = rejected
    logger.info("backend auto: %s (%s; median images/s at batch %d: %s)", served_key,
                decision["reason"], rows, _rates(rates))  # fmt: skip
    return served, decision


def measure_in_rounds(
    backends: dict[str, Backend],
    input_shape: tuple[int, int, int],
    rows: int,
    device_lock: threading.Lock | None = None,
    rounds: int = ROUNDS,
    machine: Machine | None = None,
) -> dict[str, list[float]]:
    """Each backend's forward rate, once per round, the order turned by one each round, each
    timing under ``device_lock``; ``LONG_ROUNDS`` rounds at most where the slowest takes over
    ``LONG_PASS_SECONDS`` a batch."""
    rate = (machine or Machine.here()).rate
    keys = list(backends)
    measured: dict[str, list[float]] = {key: [] for key in keys}
    for round_index in range(rounds):
        if round_index == LONG_ROUNDS and _longest_pass(measured, rows) > LONG_PASS_SECONDS:
            break
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            with device_lock or contextlib.nullcontext():
                measured[key].append(rate(backends[key], input_shape, rows, ROUND_SECONDS))
    return measured


def _longest_pass(measured: dict[str, list[float]], rows: int) -> float:
    """Seconds the slowest candidate's first timed batch took."""
    return rows / max(min(rates[0] for rates in measured.values()), 1e-9)


def beats(faster: list[float], slower: list[float]) -> bool:
    """Whether the first candidate is faster than the second beyond the noise: the median of
    its per-round ratios exceeds 1 by more than half their spread."""
    ratios = [a / b for a, b in zip(faster, slower, strict=True) if b > 0]
    if not ratios:
        return False
    margin = statistics.median(ratios) - 1
    noise = (max(ratios) - min(ratios)) / 2
    return margin > noise


def preference(rounds: dict[str, list[float]]) -> tuple[list[str], list[str]]:
    """The candidates in the order they are tried (``rounds``' keys run simplest first), and
    which of them measured within the noise of the fastest (empty when it is beyond it).

    The fastest by median comes first if it beats every other beyond the noise; otherwise the
    simplest of those it does not beat does, then the rest by speed."""
    rates = {key: statistics.median(measured) for key, measured in rounds.items()}
    by_speed = sorted(rates, key=rates.__getitem__, reverse=True)
    best = by_speed[0]
    within = [key for key in rounds if key == best or not beats(rounds[best], rounds[key])]
    if len(within) == 1:
        return by_speed, []
    first = within[0]  # the simplest
    return [first, *(key for key in by_speed if key != first)], within


def _first_that_passes(
    order: list[str], built: dict[str, Backend], failures: Callable[[Backend], list[str]]
) -> tuple[Backend, dict[str, list[str]]]:
    """The first candidate in ``order`` whose start-up check passes, and the failures of those
    before it; the others are let go."""
    rejected: dict[str, list[str]] = {}
    for key in order:
        backend = built.pop(key)
        failed = failures(backend)
        if not failed:
            built.clear()
            gc.collect()
            return backend, rejected
        logger.warning("backend auto: %s failed its start-up check, trying the next: %s",
                       key, "; ".join(failed))  # fmt: skip
        rejected[key] = failed
        del backend
    raise StartupError(
        "BACKEND=auto: every candidate failed its start-up check: "
        + "; ".join(f"{key}: {' '.join(failed)}" for key, failed in rejected.items())
    )


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())

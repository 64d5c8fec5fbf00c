"""``SHARDS``: whether a CPU runs each batch whole, every operation over all of its threads, or
as parts side by side, each on its share of the threads (``backends.sharded``).

Which is faster depends on the model and the CPU: a small model's short operations split
badly over threads (SSDlite on ONNX Runtime: 137 images/s in two parts against 103 whole on
two cores), a large model's long ones split well (``benchmarks/studies/shards/``). So
``SHARDS=auto`` measures the backend that serves both ways, in alternating rounds as
``BACKEND=auto`` measures backends, with as many parts as threads (at most the batch it
measures), and splits only when that is faster beyond the noise of the rounds; within the
noise the batch runs whole, the simpler. The decision is kept beside the artefacts, keyed by
what it depends on, so that later starts measure nothing: a classifier, which measures alike
both ways, would otherwise pay a second of timing at every start. ``SHARDS=N`` splits into N
parts without measuring. On a GPU, and for a backend that pads batches to
buckets, batches run whole.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import statistics
import threading
from typing import Any

import torch
from pydantic import BaseModel

from app.cpus import cpu_model
from app.engine.backends import Backend, sharded_backend
from app.engine.choice import beats, measure_in_rounds, runtime_versions
from app.engine.errors import StartupError
from app.engine.int8.int8_class import this_cpu
from app.engine.machine import Machine
from app.engine.model.artifacts import keep_json, read_json
from app.engine.model.kept import code_fingerprint, read_kept
from app.model_config import ModelConfig

logger = logging.getLogger("batchserve")

FOLDER = "shards-choice"
WHOLE = "whole"


class Decision(BaseModel):
    """A kept decision, as it must read back."""

    shards: int
    rates: dict[str, float]


def parts_wanted(config: ModelConfig, backend: Backend, rows: int) -> int:
    """How many parts ``SHARDS`` asks of batches of ``rows`` (1: whole); ``StartupError`` for
    an explicit count this backend cannot split into."""
    asked = config.shards
    if asked == 1:
        return 1
    whole_only = _runs_whole(backend)
    if asked == "auto":
        return 1 if whole_only else min(config.threads, rows)
    if whole_only:
        raise StartupError(f"SHARDS={asked}: {whole_only}; serve SHARDS=1 or auto")
    if asked > config.threads:
        raise StartupError(
            f"SHARDS={asked} exceeds the {config.threads} threads of a forward pass "
            "(TORCH_THREADS): each part runs on one thread at least"
        )
    if asked > config.max_batch_size:
        raise StartupError(
            f"SHARDS={asked} exceeds MAX_BATCH_SIZE={config.max_batch_size}: no batch would "
            "ever be split"
        )
    return asked


def _runs_whole(backend: Backend) -> str | None:
    """Why ``backend`` runs every batch whole, or None when it can split one."""
    if backend.device.type != "cpu":
        return "on a GPU a batch runs whole"
    if backend.fixed_shapes:
        return f"{backend.name} ({backend.variant}) pads every batch to a bucket"
    return None


def shard(
    backend: Backend,
    config: ModelConfig,
    *,
    model_digest: str,
    input_shape: tuple[int, int, int],
    rows: int,
    device_lock: threading.Lock | None = None,
    machine: Machine | None = None,
) -> Backend:
    """``backend``, or its model in parts side by side when ``SHARDS`` asks for them or, with
    ``auto``, when they measure faster here at batches of ``rows``."""
    parts = parts_wanted(config, backend, rows)
    if parts == 1:
        return backend
    threads_each = config.threads // parts
    if config.shards != "auto":
        split = sharded_backend(backend, parts, threads_each)
        split.decision = {"reason": f"SHARDS={parts}"}
        return split
    digest = _key(config, backend, model_digest, rows, parts)
    path = config.artifacts_dir / FOLDER / f"{digest}.json"
    kept = read_kept(path, Decision, "shards choice")
    if kept is not None:
        logger.info("shards auto: %s, measured before (%s)", _described(kept.shards, threads_each),
                    _rates(kept.rates))  # fmt: skip
        if kept.shards == 1:
            return backend
        split = sharded_backend(backend, kept.shards, threads_each)
        split.decision = {**(read_json(path) or {}), "reused": True}
        return split
    split = sharded_backend(backend, parts, threads_each)
    key = f"{parts} parts"
    rounds = measure_in_rounds({WHOLE: backend, key: split}, input_shape, rows, device_lock,
                               machine=machine)  # fmt: skip
    rates = {name: statistics.median(measured) for name, measured in rounds.items()}
    decision: dict[str, Any] = {
        "rates": rates, "rounds": rounds, "rows": rows,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    if beats(rounds[key], rounds[WHOLE]):
        decision |= {"shards": parts, "reason": "faster in parts beyond the noise"}
    elif beats(rounds[WHOLE], rounds[key]):
        decision |= {"shards": 1, "reason": "faster whole beyond the noise"}
    else:
        decision |= {"shards": 1, "reason": "within the noise of one another: whole, the "
                     "simpler"}  # fmt: skip
    keep_json(path, decision)
    logger.info("shards auto: %s (%s; median images/s at batch %d: %s)",
                _described(decision["shards"], threads_each), decision["reason"], rows,
                _rates(rates))  # fmt: skip
    if decision["shards"] == 1:
        return backend
    split.decision = decision
    return split


def _key(config: ModelConfig, backend: Backend, model_digest: str, rows: int, parts: int) -> str:
    """What a kept decision depends on: the model, the backend as it is configured, the
    batch it was measured at, the CPU, the runtimes' versions and the code."""
    key = {
        "model": config.model, "weights": model_digest, "options": backend.options(),
        "threads": config.threads, "rows": rows, "parts": parts, "cpu": cpu_model(),
        "int8_class": this_cpu().name, "torch": torch.__version__,
        "versions": runtime_versions(), "code": code_fingerprint(),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _described(shards: int, threads_each: int) -> str:
    if shards == 1:
        return "whole batches"
    return f"{shards} parts of a batch side by side, {threads_each} thread(s) each"


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())

"""Model cards: what a start needs to know of a model without building it.

A start that serves a kept, checked artefact (an ONNX or OpenVINO model with its start-up
verdict, or a TorchScript model with its drift verdict) needs the model's labels, its
evaluation transform and the digest of its weights (which names the artefacts), not the eager
module: building that (importing torchvision, initialising or reading the weights, hashing
them) took a third of a cached start. The first start that builds the model keeps a card of it
beside the artefacts; later starts with the same config read the card, and build the module
only if something asks for it (a missing artefact, a check to run again).

A card is found by everything the model depends on: the model's name and weights setting, the
checkpoint file's path, size and modification time, the labels file's contents, the input
sizes, the code, the torch and torchvision versions, and for pretrained weights the torch hub
cache's state. It holds the checkpoint's sha256, and a start that uses it hashes the
checkpoint again in a thread while the runtime compiles: a file replaced by other weights of
the same size under the same modification time (``rsync -a``, ``tar``, images built with
fixed timestamps) has another sha256, and the start then throws away what the card named and
builds from the checkpoint (``LoadedModel.stale``). Only torchvision's architectures get cards:
a ``package.module:factory`` model's code can change under the same config, so it is always
built. A module built later for a card must have the card's digest, or the start stops.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from torch import nn

from app.engine.model.artifacts import file_sha256, keep_json, weights_digest
from app.engine.model.kept import code_fingerprint, read_kept
from app.engine.model.loading import ContentCheck, LoadedModel, ModelLoadError
from app.engine.model.yolo_files import yolo_path
from app.model_config import ModelConfig
from preprocessing import TransformConfig

logger = logging.getLogger("batchserve")

FOLDER = "model-cards"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _file_identity(path: Path) -> list[Any] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _hub_state() -> list[Any] | None:
    """The torch hub cache's checkpoints folder (pretrained weights appear or go there)."""
    import torch

    return _file_identity(Path(torch.hub.get_dir()) / "checkpoints")


def card_path(config: ModelConfig) -> Path | None:
    """Where the card of the model these config name is kept, or None for a model that gets
    no card (a factory's)."""
    if ":" in config.model:
        return None
    weights = config.weights.strip()
    labels = config.labels
    file = checkpoint_of(config)
    checkpoint = file is not None
    key = {
        "model": config.model,
        "weights": weights,
        "checkpoint": _file_identity(file) if file is not None else None,
        # Pretrained weights come from the hub cache (WEIGHTS=auto falls back to random
        # weights when they are not there): a file added or removed there makes a new card.
        "hub": None if checkpoint or weights.lower() == "none" else _hub_state(),
        "labels": hashlib.sha256(labels.read_bytes()).hexdigest() if labels else None,
        "image_size": config.image_size,
        "resize_size": config.resize_size,
        "task": config.task,
        "fit": config.fit,
        "versions": {name: _version(name) for name in ("torch", "torchvision", "ultralytics")},
        "code": code_fingerprint(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return config.artifacts_dir / FOLDER / f"{digest}.json"


def checkpoint_of(config: ModelConfig) -> Path | None:
    """The checkpoint file the model (a YOLO file) or the weights setting names, if one
    does."""
    model = yolo_path(config.model)
    if model is not None:
        return model if model.is_file() else None
    path = Path(config.weights.strip())
    return path if path.is_file() else None


class ModelCard(BaseModel):
    """A kept card, as it must read back."""

    name: str
    weights: str
    digest: str
    labels: list[str]
    transform: dict[str, Any]
    checkpoint_sha256: str | None = None
    task: str = "classify"
    dimensions: int = 0
    instances: list[str] = []
    clips_boxes: bool = True
    resizes_logits: bool = False


class StaleCardError(ModelLoadError):
    """A card's model, built, holds other weights than the card says (its checkpoint was
    replaced under the same size and modification time): the start builds from the checkpoint
    instead, and keeps a new card."""


def keep_card(path: Path, loaded: LoadedModel, digest: str, checkpoint: Path | None) -> None:
    keep_json(path, {
        "name": loaded.name, "weights": loaded.weights, "digest": digest,
        "labels": list(loaded.labels),
        "transform": loaded.transform.as_dict(),
        "task": loaded.task, "dimensions": loaded.dimensions,
        "instances": list(loaded.instances), "clips_boxes": loaded.clips_boxes,
        "resizes_logits": loaded.resizes_logits,
        "checkpoint_sha256": file_sha256(checkpoint) if checkpoint is not None else None,
    })  # fmt: skip


def from_card(
    path: Path, build: Callable[[], nn.Module], checkpoint: Path | None = None
) -> LoadedModel | None:
    """The model a kept card describes, its module built by ``build()`` when first asked
    for (and checked against the card's digest then), or None when there is no usable card.
    ``checkpoint`` is hashed at once in a thread, to be compared with the card's when the
    start asks whether the card was stale."""
    card = read_kept(path, ModelCard, "model card")
    if card is None:
        return None
    try:
        values = card.transform
        if set(values) != set(TransformConfig.__dataclass_fields__):
            raise ValueError("a transform of another version")
        transform = TransformConfig(**values)
    except (KeyError, TypeError, ValueError):
        logger.warning("ignoring the unreadable model card %s", path)
        return None
    if (checkpoint is None) != (card.checkpoint_sha256 is None):
        return None  # a card of another kind of weights
    digest, name, weights = card.digest, card.name, card.weights

    def checked_build() -> nn.Module:
        module = build()
        if weights_digest(module) != digest:
            raise StaleCardError(
                f"the model card {path} no longer describes {name} as these config build it "
                f"(its weights changed)"
            )
        return module

    content = None
    if checkpoint is not None and card.checkpoint_sha256 is not None:
        content = ContentCheck(checkpoint, card.checkpoint_sha256)
    logger.info("model %s from its card (%s): built only if needed", name, path)
    return LoadedModel(name, None, weights, tuple(card.labels), transform, build=checked_build,
                       digest=digest, content=content, task=card.task,
                       dimensions=card.dimensions,
                       instances=tuple(card.instances),
                       clips_boxes=card.clips_boxes,
                       resizes_logits=card.resizes_logits)  # fmt: skip


def load_described(
    config: ModelConfig, load: Callable[[], LoadedModel], *, use_card: bool = True
) -> LoadedModel:
    """The model the config name: from its card when one is kept (and ``use_card``), else
    ``load()`` (which builds it), keeping a card for the next start."""
    path = card_path(config)
    checkpoint = checkpoint_of(config)
    if path is not None and use_card:
        described = from_card(path, lambda: load().module, checkpoint)
        if described is not None:
            return described
    loaded = load()
    if path is not None:
        if loaded.digest is None:
            loaded.digest = weights_digest(loaded.module)
        keep_card(path, loaded, loaded.digest, checkpoint)
    return loaded

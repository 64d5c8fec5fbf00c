"""Exported models on disk: where each lives, and how it is written so that none is half-made.

An artefact is a directory under ``ARTIFACTS_DIR`` named by everything that changes its
contents: the model, a digest of its weights, the input size, the precision and the exporter
(with its version). A directory is made under a temporary name and renamed into place in one
step, so a crash or a concurrent replica never leaves (or reads) a partial artefact; the next
start-up finds a finished one and reuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPORT = "report.json"  # the accuracy gate's report, beside an INT8 model

logger = logging.getLogger("batchserve")


def weights_digest(module: nn.Module) -> str:
    """A digest of every parameter and buffer (names, shapes, dtypes, values)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        data = tensor.detach().cpu().reshape(-1).contiguous()
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def file_sha256(*paths: Path) -> str:
    """sha256 of the files' contents, one after the other, read in blocks."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ArtifactKey:
    model: str
    weights: str  # a weights digest
    crop_size: int
    precision: str
    exporter: str  # e.g. "onnx-torch2.14.1-opset18"

    @property
    def dirname(self) -> str:
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model).strip("_") or "model"
        exporter = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.exporter)
        return f"{model}-{self.weights[:16]}-{self.crop_size}-{self.precision}-{exporter}"

    def path(self, root: Path) -> Path:
        return root / self.dirname


def find(root: Path, key: ArtifactKey, filename: str) -> Path | None:
    """The finished artefact file, or None."""
    path = key.path(root) / filename
    return path if path.is_file() else None


@contextlib.contextmanager
def building(root: Path, key: ArtifactKey, *, replace: bool = False) -> Iterator[Path]:
    """A scratch directory to write an artefact into; renamed to its final place when the
    block ends without error, removed otherwise. If another process finished the same
    artefact first, theirs is kept (the two are equivalent), unless ``replace``: then the new
    one takes the place of the old (a rebuild with other inputs)."""
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key.dirname}.", dir=root))
    final = key.path(root)
    try:
        yield scratch
        (scratch / "key.json").write_text(json.dumps(key.__dict__, indent=2) + "\n")
        if replace and final.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{key.dirname}.old.", dir=root))
            final.rename(old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            scratch.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a JSON file atomically (a temporary file renamed over it)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    partial.replace(path)


def keep_json(path: Path, data: dict[str, Any]) -> None:
    """``write_json`` for a record that saves later starts work, where failing to write must
    not stop this one (a cache mounted read-only): logged, and the next start does it again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, data)
    except OSError as exc:
        logger.warning("cannot keep %s (%s): the next start will do this work again", path, exc)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

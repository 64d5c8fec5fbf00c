"""Kept records: what a start remembers for the next one, and when it may believe it.

Model cards, start-up verdicts, INT8 reports and ``BACKEND=auto``'s choice are written once
and read by every later start (and by every replica sharing the artefact cache). Each is bound
to a fingerprint of the code that wrote it, so that an upgrade decides again rather than trust
what older code concluded, and each is validated against its schema when read: a file that is
not what it should be (cut short, edited, written by another version) is reported once and
measured again, never a crash and never believed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from app.engine.model.artifacts import read_json

logger = logging.getLogger("batchserve")

Record = TypeVar("Record", bound=BaseModel)

# The packages whose code decides what a kept record says.
_PACKAGES = ("app", "batching", "preprocessing")


@functools.cache
def code_fingerprint() -> str:
    """batchserve's version and a digest of its source files: any change to the code makes
    another fingerprint. Hashing them takes a few milliseconds, once per process."""
    digest = hashlib.sha256()
    try:
        digest.update(importlib.metadata.version("batchserve").encode())
    except importlib.metadata.PackageNotFoundError:
        digest.update(b"-")
    root = Path(__file__).resolve().parents[3]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def read_kept(path: Path, schema: type[Record], what: str) -> Record | None:
    """The record at ``path`` validated by ``schema``, or None: silently when there is none,
    with a warning when the file is there but unreadable (it will be made again)."""
    if not path.exists():
        return None
    data = read_json(path)
    try:
        if data is None:
            raise ValueError("not a JSON object")
        return schema.model_validate(data)
    except (ValueError, ValidationError) as exc:
        reason = str(exc).splitlines()[0]
        logger.warning("ignoring the unreadable %s %s (%s): measuring again", what, path, reason)
        return None

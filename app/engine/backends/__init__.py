"""Runtimes for the forward pass, each behind the one small ``Backend`` interface."""

from __future__ import annotations

from app.engine.backends.base import Backend
from app.engine.backends.pytorch import TorchBackend

__all__ = ["Backend", "TorchBackend"]

"""Model loading, device and precision, backends, and the batched inference engine."""

from __future__ import annotations

from app.engine.backends import Backend, TorchBackend
from app.engine.device import (
    DeviceError,
    precision_candidates,
    resolve_decode_device,
    resolve_device,
)
from app.engine.engine import ImageRequest, InferenceEngine, Prediction
from app.engine.errors import StartupError
from app.engine.factory import build_engine
from app.engine.loading import LoadedModel, ModelLoadError, load_model
from app.engine.observer import BatchReport, EngineObserver

__all__ = [
    "Backend",
    "BatchReport",
    "DeviceError",
    "EngineObserver",
    "ImageRequest",
    "InferenceEngine",
    "LoadedModel",
    "ModelLoadError",
    "Prediction",
    "StartupError",
    "TorchBackend",
    "build_engine",
    "load_model",
    "precision_candidates",
    "resolve_decode_device",
    "resolve_device",
]

"""Model loading, device and precision, and the batched inference engine."""

from __future__ import annotations

from app.engine.compile import resolve_compile
from app.engine.device import (
    DeviceError,
    resolve_decode_device,
    resolve_device,
    resolve_inflight,
    resolve_precision,
)
from app.engine.engine import InferenceEngine, InferenceRequest, Prediction
from app.engine.loading import LoadedModel, ModelLoadError, load_model
from app.metrics import Metrics
from app.settings import Settings
from preprocessing import ImageLimits

__all__ = [
    "DeviceError",
    "InferenceEngine",
    "InferenceRequest",
    "LoadedModel",
    "ModelLoadError",
    "Prediction",
    "build_engine",
    "load_model",
    "resolve_decode_device",
    "resolve_device",
    "resolve_inflight",
    "resolve_precision",
]


def build_engine(settings: Settings, metrics: Metrics | None = None) -> InferenceEngine:
    """Load the configured model onto the configured device, in the configured precision."""
    device = resolve_device(settings.device)
    dtype = resolve_precision(settings.precision, device)
    loaded = load_model(
        settings.model,
        settings.weights,
        settings.labels,
        settings.image_size,
        settings.resize_size,
    )
    limits = ImageLimits(
        max_pixels=settings.max_image_pixels,
        resize_size=loaded.transform.resize_size,
        min_side=settings.min_image_size,
    )
    config = settings.batch_config(resolve_inflight(settings.max_inflight_batches, device))
    return InferenceEngine(
        loaded,
        device,
        dtype,
        limits=limits,
        metrics=metrics,
        max_batch_size=config.max_batch_size,
        buckets=config.batch_buckets,
        max_inflight_batches=config.max_inflight_batches,
        decode_on_device=resolve_decode_device(settings.decode_device, device),
        cuda_graphs=settings.cuda_graphs,
        compile_mode=resolve_compile(settings.compile, device),
    )

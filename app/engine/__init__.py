"""Model loading, device and precision, backends, and the batched inference engine."""

from __future__ import annotations

import copy

import torch

from app.engine.backends import Backend, TorchBackend
from app.engine.compile import resolve_compile
from app.engine.device import (
    DeviceError,
    precision_candidates,
    resolve_decode_device,
    resolve_device,
)
from app.engine.engine import InferenceEngine, InferenceRequest, Prediction
from app.engine.loading import LoadedModel, ModelLoadError, load_model
from app.engine.observer import BatchReport, EngineObserver
from app.engine.precision import fastest
from app.settings import Settings
from batching import BatchConfig
from preprocessing import ImageLimits

__all__ = [
    "Backend",
    "BatchReport",
    "DeviceError",
    "EngineObserver",
    "InferenceEngine",
    "InferenceRequest",
    "LoadedModel",
    "ModelLoadError",
    "Prediction",
    "TorchBackend",
    "build_engine",
    "load_model",
    "precision_candidates",
    "resolve_decode_device",
    "resolve_device",
]


def build_engine(
    settings: Settings, config: BatchConfig, observer: EngineObserver | None = None
) -> InferenceEngine:
    """Load the configured model onto the configured device, in the configured precision.

    ``config`` is the batcher's configuration (``settings.batch_config``): the engine sizes
    its slots and batch buckets from it.
    """
    device = resolve_device(settings.device)
    torch.set_num_threads(settings.intra_op_threads)
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
    input_shape = (3, loaded.transform.crop_size, loaded.transform.crop_size)
    candidates = precision_candidates(settings.precision, device)

    def build(dtype: torch.dtype) -> Backend:
        # Each candidate converts its own copy: .to(dtype) changes a module in place.
        module = loaded.module if len(candidates) == 1 else copy.deepcopy(loaded.module)
        return TorchBackend(
            module,
            device,
            dtype,
            input_shape,
            compile_mode=resolve_compile(settings.compile, device),
            cuda_graphs=settings.cuda_graphs,
        )

    backend, rates = fastest(candidates, build, input_shape, min(8, config.max_batch_size))
    backend.measured_rates = rates
    return InferenceEngine(
        loaded,
        backend,
        limits=limits,
        observer=observer,
        max_batch_size=config.max_batch_size,
        buckets=config.batch_buckets,
        max_inflight_batches=config.max_inflight_batches,
        decode_on_device=resolve_decode_device(settings.decode_device, device),
    )

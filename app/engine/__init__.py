"""Model loading, device and precision, backends, and the batched inference engine.

This package's names are the engine's public surface: the server's other parts, the tools
and the benchmarks import from here, never from its modules."""

from __future__ import annotations

from app.engine.backends import Backend, TorchBackend, sharded_backend
from app.engine.checks.gate import Bounds, compare, eager_reference, probabilities, verdict
from app.engine.checks.task_gate import compare_answers
from app.engine.device import (
    DeviceError,
    precision_candidates,
    resolve_decode_device,
    resolve_device,
)
from app.engine.engine import ImageRequest, InferenceEngine, Prediction
from app.engine.errors import StartupError
from app.engine.factory import build_engine, load_configured_model
from app.engine.int8.int8_class import named, this_cpu
from app.engine.int8.int8_report import GATE_IMAGES, int8_bounds
from app.engine.int8.quantize import build_int8, calibration_batches, plain_recipe
from app.engine.machine import Machine, fixed_rates
from app.engine.model.artifacts import REPORT, read_json
from app.engine.model.export import ONNX_FILE, OPENVINO_FILE, convert_to_openvino, export_onnx
from app.engine.model.loading import LoadedModel, ModelLoadError, load_model
from app.engine.observer import BatchReport, EngineObserver
from app.engine.pipeline.graphs import bucket_for
from app.engine.tasks import resolve_task
from app.engine.tasks.answers import Detected
from app.engine.warmup import synthetic_jpegs, synthetic_photo, warmup_images

__all__ = [
    "GATE_IMAGES",
    "ONNX_FILE",
    "OPENVINO_FILE",
    "REPORT",
    "Backend",
    "BatchReport",
    "Bounds",
    "Detected",
    "DeviceError",
    "EngineObserver",
    "ImageRequest",
    "InferenceEngine",
    "LoadedModel",
    "Machine",
    "ModelLoadError",
    "Prediction",
    "StartupError",
    "TorchBackend",
    "bucket_for",
    "build_engine",
    "build_int8",
    "calibration_batches",
    "compare",
    "compare_answers",
    "convert_to_openvino",
    "eager_reference",
    "export_onnx",
    "fixed_rates",
    "int8_bounds",
    "load_configured_model",
    "load_model",
    "named",
    "plain_recipe",
    "precision_candidates",
    "probabilities",
    "read_json",
    "resolve_decode_device",
    "resolve_device",
    "resolve_task",
    "sharded_backend",
    "synthetic_jpegs",
    "synthetic_photo",
    "this_cpu",
    "verdict",
    "warmup_images",
]

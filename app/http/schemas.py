"""Response shapes, for the OpenAPI document (responses are rendered by orjson)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ClassScore(BaseModel):
    index: int
    label: str
    score: float


class PredictResponse(BaseModel):
    model: str
    predictions: list[ClassScore]


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class Status(BaseModel):
    status: str
    state: str
    reason: str | None = None


class BatchingInfo(BaseModel):
    max_batch_size: int
    max_queue_delay_ms: float
    preferred_batch_sizes: list[int]
    max_queue_size: int
    max_queue_bytes: int
    max_inflight_batches: int
    latency_slo_ms: float | None
    dispatch_when_idle: bool
    request_timeout_ms: float


class ModelInfo(BaseModel):
    model: str
    version: str
    name: str
    weights: str
    device: str
    precision: str
    state: str
    version_state: str
    backend: dict[str, Any]
    check: dict[str, Any] | None
    cpu: dict[str, Any]
    task: str
    input_shape: list[int]
    letterbox: bool
    resize_size: int
    num_classes: int
    mean: list[float]
    std: list[float]
    interpolation: str
    batching: BatchingInfo
    # Start-up by phase, in seconds: this model's load, and the process's (see app.startup).
    startup_s: dict[str, dict[str, float]]
    warmup_ms: dict[int, float]


class RepositoryEntry(BaseModel):
    name: str
    version: str | None = None
    state: str
    reason: str


class ModelList(BaseModel):
    models: list[ModelInfo]
    repository: list[RepositoryEntry]

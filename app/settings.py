"""Settings from ``BATCHSERVE_*`` environment variables and ``.env``, validated at startup."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.cpus import available_cpus
from batching import BatchConfig, parse_sizes

ENV_PREFIX = "BATCHSERVE_"

Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]
BackendName = Literal["auto", "torch", "onnxruntime", "openvino"]
DecodeDevice = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ModelControl = Literal["none", "explicit"]
# An API key shorter than this is refused at start-up: an empty one (a variable left unset in
# a secret) would otherwise let requests without a key through, and a short one is guessable.
MIN_API_KEY_BYTES = 16
# Fields whose values an error message never repeats.
_SECRET_FIELDS = frozenset({"api_key"})
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

# The settings that are about a model rather than the process: the keys a model repository's
# config.toml may hold (in lower case). The rest (ports, keys, admission limits, the thread
# budget, the artefact cache, logging) belong to the process and are shared by every model.
MODEL_KEYS = frozenset({
    "model", "weights", "labels", "device", "precision", "decode_device", "image_size",
    "resize_size", "cuda_graphs", "compile", "backend", "calibration_dir", "allow_ungated_int8",
    "int8_gate_min_confident_top1_agreement", "int8_gate_min_plausible_top1",
    "int8_gate_max_mean_total_variation", "int8_gate_max_probability_difference",
    "int8_gate_min_images", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes",
    "max_inflight_batches", "latency_slo_ms", "dispatch_when_idle", "warmup", "priority_levels",
    "default_priority", "request_timeout_ms", "max_request_timeout_ms", "top_k",
})  # fmt: skip


class SettingsError(ValueError):
    """Invalid settings, with one readable line per problem, named by environment variable."""


class Settings(BaseSettings):
    """Every knob of the server. Field ``x`` is read from ``BATCHSERVE_X``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", frozen=True
    )

    # The model
    model: str = Field("resnet50", min_length=1)
    weights: str = "pretrained"
    labels: Path | None = None
    device: str = "auto"
    precision: Precision = "auto"
    decode_device: DecodeDevice = "auto"
    image_size: int | None = Field(None, ge=8, le=4096)
    resize_size: int | None = Field(None, ge=8, le=8192)
    cuda_graphs: bool = False
    compile: Literal["auto", "none", "torchscript", "inductor"] = "auto"
    backend: BackendName = "auto"
    artifacts_dir: Path = Path.home() / ".cache" / "batchserve" / "artifacts"
    calibration_dir: Path | None = None
    allow_ungated_int8: bool = False
    # The INT8 accuracy gate: the INT8 model against eager fp32 PyTorch on held-out photos.
    int8_gate_min_confident_top1_agreement: float = Field(0.98, ge=0, le=1)
    int8_gate_min_plausible_top1: float = Field(0.9, ge=0, le=1)
    int8_gate_max_mean_total_variation: float = Field(0.12, ge=0, le=1)
    int8_gate_max_probability_difference: float = Field(0.25, ge=0, le=1)
    int8_gate_min_images: int = Field(30, ge=1, le=100_000)

    # Batching
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_queue_delay_ms: float | None = Field(None, ge=0, le=60_000)
    preferred_batch_sizes: Annotated[tuple[int, ...], NoDecode] = ()
    max_queue_size: int = Field(1024, ge=1)
    max_queue_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    max_inflight_batches: int | None = Field(None, ge=1, le=16)
    latency_slo_ms: float | None = Field(None, gt=0)
    dispatch_when_idle: bool = True
    # Which batch sizes warm up before ready: every bucket ("all"), or the smallest ("first",
    # the others after ready while the model is idle); "auto": all on CUDA, first on a CPU.
    warmup: Literal["auto", "all", "first"] = "auto"
    priority_levels: int = Field(3, ge=1, le=16)
    default_priority: int = Field(2, ge=1, le=16)
    request_timeout_ms: float = Field(30_000, gt=0)
    # The longest deadline a client may ask for (None: REQUEST_TIMEOUT_MS): a request's bytes
    # and its place in the queue are held that long at most.
    max_request_timeout_ms: float | None = Field(None, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)

    # Requests
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    max_image_pixels: int = Field(40_000_000, ge=1)
    max_images_per_request: int | None = Field(None, ge=1)
    min_image_size: int = Field(8, ge=1, le=4096)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    top_k: int = Field(5, ge=1)
    decode_workers: int | None = Field(None, ge=1, le=256)
    torch_threads: int | None = Field(None, ge=1, le=1024)
    workers: int = Field(1, ge=1, le=256)
    worker_index: int = Field(0, ge=0, le=255)

    # Several models
    model_repository: Path | None = None
    model_control: ModelControl = "none"
    load_models: Annotated[tuple[str, ...], NoDecode] = ()
    default_model: str | None = Field(None, pattern=MODEL_NAME_PATTERN)

    # gRPC: the Open Inference Protocol's GRPCInferenceService beside HTTP
    grpc_port: int = Field(8001, ge=0, le=65535)
    grpc_host: str | None = Field(None, min_length=1)

    # Operations
    model_name: str | None = Field(None, pattern=MODEL_NAME_PATTERN)
    api_key: SecretStr | None = None
    protect_metrics: bool = False
    log_level: LogLevel = "info"
    log_json: bool = False

    @field_validator("preferred_batch_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: Any) -> Any:
        if value is None or value == "":
            return ()
        try:
            return parse_sizes(value)
        except (TypeError, ValueError) as exc:
            raise ValueError("must be a comma-separated list of integers, e.g. 8,16") from exc

    @field_validator("load_models", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        if value is None or value == "":
            return ()
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().encode()) < MIN_API_KEY_BYTES:
            raise ValueError(
                f"must be at least {MIN_API_KEY_BYTES} bytes (got "
                f"{len(value.get_secret_value().encode())}); unset it to turn authentication off"
            )
        return value

    @field_validator("model_repository")
    @classmethod
    def _repository_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"no directory at {value}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("labels")
    @classmethod
    def _labels_exist(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no labels file at {value}")
        return value

    @field_validator("calibration_dir")
    @classmethod
    def _calibration_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"no directory at {value}")
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        value = value.strip().lower()
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("must be auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"PREFERRED_BATCH_SIZES: {size} is not between 1 and MAX_BATCH_SIZE "
                    f"({self.max_batch_size})"
                )
        if self.precision == "int8" and self.backend == "torch":
            raise ValueError(
                "PRECISION=int8 is served by BACKEND=onnxruntime or BACKEND=openvino, from a "
                "quantized artefact that passed its accuracy gate"
            )
        if self.max_request_timeout_ms is not None and (
            self.max_request_timeout_ms < self.request_timeout_ms
        ):
            raise ValueError(
                f"MAX_REQUEST_TIMEOUT_MS ({self.max_request_timeout_ms}) cannot be below "
                f"REQUEST_TIMEOUT_MS ({self.request_timeout_ms}), the deadline of requests "
                "that name none"
            )
        if (self.max_images_per_request or 0) > self.max_queue_size:
            raise ValueError(
                f"MAX_IMAGES_PER_REQUEST ({self.max_images_per_request}) cannot exceed "
                f"MAX_QUEUE_SIZE ({self.max_queue_size}): each image takes a place in the queue"
            )
        if self.worker_index >= self.workers:
            raise ValueError(
                f"WORKER_INDEX ({self.worker_index}) must be below WORKERS ({self.workers})"
            )
        if self.default_priority > self.priority_levels:
            raise ValueError(
                f"DEFAULT_PRIORITY ({self.default_priority}) cannot exceed PRIORITY_LEVELS "
                f"({self.priority_levels})"
            )
        if self.max_queue_bytes < self.max_image_bytes:
            raise ValueError(
                f"MAX_QUEUE_BYTES ({self.max_queue_bytes}) must be at least MAX_IMAGE_BYTES "
                f"({self.max_image_bytes}), or the largest accepted image could never be queued"
            )
        if (
            self.image_size is not None
            and self.resize_size is not None
            and self.image_size > self.resize_size
        ):
            raise ValueError(
                f"IMAGE_SIZE ({self.image_size}) cannot exceed RESIZE_SIZE ({self.resize_size})"
            )
        return self

    @property
    def served_name(self) -> str:
        """The name of the model these settings describe, without a repository: ``MODEL_NAME``,
        else the model setting (a factory's function name for ``pkg.mod:fn``)."""
        if self.model_name:
            return self.model_name
        return self.model.rpartition(":")[2] or self.model

    def for_model(self, values: dict[str, Any]) -> Settings:
        """These settings' process part with a model's ``values`` (from a repository's
        config.toml): validated like the environment, ``ValidationError`` otherwise. The
        model's settings not in ``values`` take their defaults, not the environment's."""
        process = {key: value for key, value in self if key not in MODEL_KEYS}
        return _Explicit(**process, **values)

    def with_backend(self, name: str, precision: str | None = None) -> Settings:
        """These settings serving ``name``, in ``precision`` when given (BACKEND=auto's
        candidates and choice)."""
        return self.model_copy(update={"backend": name, "precision": precision or self.precision})

    @property
    def queue_delay_s(self) -> float:
        """The window: explicit, else 15% of the latency SLO, else 2 ms."""
        if self.max_queue_delay_ms is not None:
            return self.max_queue_delay_ms / 1000
        if self.latency_slo_ms is not None:
            return 0.15 * self.latency_slo_ms / 1000
        return 0.002

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def images_per_request(self) -> int:
        """``MAX_IMAGES_PER_REQUEST``, by default 64 or ``MAX_QUEUE_SIZE`` if smaller."""
        return self.max_images_per_request or min(64, self.max_queue_size)

    @property
    def max_request_timeout_s(self) -> float:
        return (self.max_request_timeout_ms or self.request_timeout_ms) / 1000

    @property
    def decode_threads(self) -> int:
        return self.decode_workers or available_cpus(workers=self.workers)

    @property
    def intra_op_threads(self) -> int:
        """Threads torch (and any other runtime) uses inside one forward pass: by default
        every CPU the process may use (its affinity mask, capped by its share of a
        container's CPU quota)."""
        return self.torch_threads or available_cpus(workers=self.workers)

    def batch_config(self, device_type: str) -> BatchConfig:
        """The batcher's configuration for a model on a device of this type (``cpu``, ``cuda``).

        ``MAX_INFLIGHT_BATCHES`` defaults to 2: on CUDA batch N+1 is decoded and copied on its
        own stream while N computes; on a CPU a full batch N+1 is normalised into its input
        while N computes (the engine still runs one forward pass at a time, see
        ``BatchConfig.serial_execution``), which keeps the cores on the model between batches.
        """
        inflight = self.max_inflight_batches or 2
        return BatchConfig(
            max_batch_size=self.max_batch_size,
            max_queue_delay_s=self.queue_delay_s,
            preferred_batch_sizes=self.preferred_batch_sizes,
            max_queue_size=self.max_queue_size,
            max_inflight_batches=inflight,
            latency_slo_s=None if self.latency_slo_ms is None else self.latency_slo_ms / 1000,
            dispatch_when_idle=self.dispatch_when_idle,
            priority_levels=self.priority_levels,
            default_priority=self.default_priority - 1,
            # The version turns it off for a CPU backend that runs batches side by side.
            serial_execution=device_type != "cuda",
        )


class _Explicit(Settings):
    """Settings from the given values alone (and the defaults), not the environment."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment (and ``overrides``), or raise ``SettingsError``."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc)) from None


def settings_for_tool() -> Settings:
    """Settings for a command-line tool: one line on stderr and exit status 2 when invalid."""
    try:
        return load_settings()
    except SettingsError as exc:
        print(f"batchserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def describe_errors(exc: ValidationError) -> str:
    lines = error_lines(exc, lambda field: f"{ENV_PREFIX}{field.upper()}" if field else "settings")
    return "\n".join(["invalid settings:", *(f"  {line}" for line in lines)])


def error_lines(exc: ValidationError, name: Callable[[str], str]) -> list[str]:
    """One line per problem, the field named by ``name`` (an environment variable, a key)."""
    lines = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        value = error.get("input")
        hidden = field == "" or field in _SECRET_FIELDS or isinstance(value, dict)
        shown = "" if hidden else f" (got {value!r})"
        lines.append(f"{name(field)}: {message}{shown}")
    return lines

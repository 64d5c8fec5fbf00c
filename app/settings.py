"""Settings from ``BATCHSERVE_*`` environment variables and ``.env``, validated at startup."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    SettingsConfigDict,
)

from app.cpus import available_cpus
from app.first_try import FIRST_TRY, first_try
from app.model_config import MODEL_KEYS, Directory, ModelConfig, ModelKeys

ENV_PREFIX = "BATCHSERVE_"

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ModelControl = Literal["none", "explicit"]
# An API key shorter than this is refused at start-up: an empty one (a variable left unset in
# a secret) would otherwise let requests without a key through, and a short one is guessable.
MIN_API_KEY_BYTES = 16
# Fields whose values an error message never repeats.
_SECRET_FIELDS = frozenset({"api_key"})
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


class SettingsError(ValueError):
    """Invalid settings, with one readable line per problem, named by environment variable."""


class Settings(BaseSettings, ModelKeys):
    """Every knob of the server. Field ``x`` is read from ``BATCHSERVE_X``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        extra="ignore",
        frozen=True,
        use_attribute_docstrings=True,
    )

    # The model's own settings (``ModelKeys``) come first; then the process's:
    artifacts_dir: Path = Path.home() / ".cache" / "batchserve" / "artifacts"
    """Where exported (ONNX, OpenVINO IR) and quantized models are kept and reused; must be
    writable."""

    # Batching (the batcher's own settings are the model's)
    max_queue_size: int = Field(1024, ge=1)
    """Requests admitted and not yet dispatched; more get 503 `overloaded`."""
    max_queue_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    """Encoded bytes those requests hold together (bodies being read, images waiting to be decoded,
    JPEGs kept for the GPU decoder until dispatch); beyond it 503 `overloaded`; at least
    `MAX_IMAGE_BYTES`."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM, how long accepted requests may take to finish."""

    # Requests
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    """Larger bodies get 413 without being read."""
    max_image_pixels: int = Field(40_000_000, ge=1)
    """Checked from the header before decoding."""
    max_images_per_request: int | None = Field(None, ge=1)
    """The most images one request may carry (422 beyond, `INVALID_ARGUMENT` over gRPC); each
    counts against `MAX_QUEUE_SIZE` as soon as the request is parsed. Unset: 64 (at most
    `MAX_QUEUE_SIZE`)."""
    min_image_size: int = Field(8, ge=1, le=4096)
    """Smallest accepted side in pixels (400 below it)."""
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    """Request headers larger than this get 431."""
    decode_workers: int | None = Field(None, ge=1, le=256)
    """Threads that decode images. Unset: available CPUs."""
    torch_threads: int | None = Field(None, ge=1, le=1024)
    """Threads of one forward pass (torch's intra-op threads, or the runtime's); "available" is the
    process's affinity mask capped by its container's CPU quota, not the host's core count.
    Beside a runtime, torch's own steps (normalising a batch, its top classes, and so the decode
    threads' resizing too) run on one thread (see [torch's threads beside a
    runtime](studies/torch_threads/README.md)). Unset: available CPUs."""
    workers: int = Field(1, ge=1, le=256)
    """The workers on one host (one per GPU, or per share of the CPUs); see
    [Deployment](deployment.md)."""
    worker_index: int = Field(0, ge=0, le=255)
    """This process is worker `WORKER_INDEX` of `WORKERS` on one host: it takes GPU `WORKER_INDEX`
    (with `DEVICE=auto`), or that share of the CPUs (pinned, with as many threads); see
    [Deployment](deployment.md)."""

    # Several models
    model_repository: Directory | None = None
    """A model repository: several models and versions in one process; see [Several
    models](repository.md)."""
    model_control: ModelControl = "none"
    """`none`: every model of the repository loads at start, the repository API refuses to load or
    unload; `explicit`: `LOAD_MODELS` load at start, then as the API asks."""
    load_models: Annotated[tuple[str, ...], NoDecode] = ()
    """Comma-separated models loaded at start under `MODEL_CONTROL=explicit`."""
    default_model: str | None = Field(None, pattern=MODEL_NAME_PATTERN)
    """The model of `/predict` without `?model=`. Unset: the only model."""

    # gRPC: the Open Inference Protocol's GRPCInferenceService beside HTTP
    grpc_port: int = Field(8001, ge=0, le=65535)
    """The Open Inference Protocol over gRPC on this port (`0`: off); see
    [gRPC](protocol.md#the-open-inference-protocol-over-grpc)."""
    grpc_host: str | None = Field(None, min_length=1)
    """The address gRPC listens on (uvicorn's `--host` or `UVICORN_HOST`, else `127.0.0.1` as
    uvicorn's default). Unset: uvicorn's `--host`."""

    # Operations
    model_name: str | None = Field(None, pattern=MODEL_NAME_PATTERN)
    """Without a repository: the model's name in `/predict?model=` and the Open Inference
    Protocol's URLs (`/v2/models/<name>/infer`). Unset: the model (a factory's function name,
    a YOLO file's name without its suffix: `best` for `runs/detect/train/weights/best.pt`)."""
    api_key: SecretStr | None = None
    """At least 16 bytes (a shorter or empty one stops start-up): require `Authorization: Bearer
    <key>` on `/predict`, `/v1/models` and the `/v2` metadata and inference routes, and as
    `authorization` call metadata on every gRPC call but health."""
    protect_metrics: bool = False
    """Require the key on `/metrics` too."""
    log_level: LogLevel = "info"
    """`critical`, `error`, `warning`, `info`, `debug`."""
    log_json: bool = False
    """One JSON object per log line, with the request id."""

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

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # The model's own keys are checked by ModelKeys; these are the process's.
        if (self.max_images_per_request or 0) > self.max_queue_size:
            raise ValueError(
                f"MAX_IMAGES_PER_REQUEST ({self.max_images_per_request}) cannot exceed "
                f"MAX_QUEUE_SIZE ({self.max_queue_size}): each image takes a place in the queue"
            )
        if self.worker_index >= self.workers:
            raise ValueError(
                f"WORKER_INDEX ({self.worker_index}) must be below WORKERS ({self.workers})"
            )
        if self.max_queue_bytes < self.max_image_bytes:
            raise ValueError(
                f"MAX_QUEUE_BYTES ({self.max_queue_bytes}) must be at least MAX_IMAGE_BYTES "
                f"({self.max_image_bytes}), or the largest accepted image could never be queued"
            )
        return self

    @property
    def served_name(self) -> str:
        """The name of the model these settings describe, without a repository: ``MODEL_NAME``,
        else the model setting (a factory's function name for ``pkg.mod:fn``)."""
        if self.model_name:
            return self.model_name
        model = first_try().model if self.model == FIRST_TRY else self.model
        if ":" not in model and PurePath(model).suffix in (".pt", ".torchscript"):
            return PurePath(model).stem  # a YOLO file: best.pt serves as "best"
        if model.startswith("hf:"):
            return PurePath(model.removeprefix("hf:")).name  # hf:facebook/detr-resnet-50
        if ":" not in model and Path(model).is_dir():
            return Path(model).resolve().name  # a directory save_pretrained wrote
        return model.rpartition(":")[2] or model

    def for_model(self, values: dict[str, Any], name: str | None = None) -> ModelConfig:
        """A model with ``values`` for its keys (from a repository's config.toml: the keys
        not in ``values`` take their defaults, not the environment's), and what this process
        grants every model; ``ValidationError`` when they do not validate."""
        return ModelConfig(**values, **self._granted(name or self.served_name))

    def own_model(self) -> ModelConfig:
        """The model these settings name (without a repository, the only one)."""
        keys = {key: getattr(self, key) for key in MODEL_KEYS}
        return ModelConfig(**keys, **self._granted(self.served_name))

    def _granted(self, name: str) -> dict[str, Any]:
        return {
            "name": name, "threads": self.intra_op_threads, "artifacts_dir": self.artifacts_dir,
            "max_image_pixels": self.max_image_pixels, "min_image_size": self.min_image_size,
            "worker_index": self.worker_index, "max_queue_size": self.max_queue_size,
        }  # fmt: skip

    @property
    def images_per_request(self) -> int:
        """``MAX_IMAGES_PER_REQUEST``, by default 64 or ``MAX_QUEUE_SIZE`` if smaller."""
        return self.max_images_per_request or min(64, self.max_queue_size)

    @property
    def decode_threads(self) -> int:
        return self.decode_workers or available_cpus(workers=self.workers)

    @property
    def intra_op_threads(self) -> int:
        """Threads torch (and any other runtime) uses inside one forward pass: by default
        every CPU the process may use (its affinity mask, capped by its share of a
        container's CPU quota)."""
        return self.torch_threads or available_cpus(workers=self.workers)


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

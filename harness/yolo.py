"""Ultralytics YOLO models to serve offline (the tests' and the benchmarks'): built from
Ultralytics' own model YAMLs (nothing downloaded), their weights drawn again from a fixed seed
so that scores spread (``harness.spread``), saved as Ultralytics checkpoints (``YOLO.save``,
what ``yolo train`` leaves) and exported to TorchScript by Ultralytics' own exporter. Needs
the ``yolo`` extra."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from harness.photos import photos
from harness.spread import spread

YAMLS = {
    "detect": "yolo11n.yaml",
    "pose": "yolo11n-pose.yaml",
    "segment": "yolo11n-seg.yaml",
    "classify": "yolo11n-cls.yaml",
    "obb": "yolo11n-obb.yaml",
}
SIZES = {"classify": 224}


def checkpoint(task: str, folder: Path, name: str | None = None) -> Path:
    """A YOLO11n checkpoint of ``task`` with spread weights (made once per folder), saved as
    ``<name>.pt`` (by default ``yolo11n-<task>.pt``)."""
    path = folder / f"{name or f'yolo11n-{task}'}.pt"
    if not path.exists():
        from ultralytics import YOLO

        model = YOLO(YAMLS[task])
        batch = _letterboxed(SIZES.get(task, 640))
        spread(model.model, lambda module: module(batch), seed=0, sigmoid_confident=1e-4)
        model.save(str(path))
    return path


def torchscript(task: str, folder: Path) -> Path:
    """The checkpoint exported by Ultralytics to TorchScript (its metadata in ``config.txt``)."""
    path = checkpoint(task, folder).with_suffix(".torchscript")
    if not path.exists():
        from ultralytics import YOLO

        # Tracing warns (deprecated; tensors read as Python values): Ultralytics' exporter.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = YOLO(str(checkpoint(task, folder))).export(
                format="torchscript", imgsz=SIZES.get(task, 640), verbose=False
            )
        assert Path(exported) == path, exported
    return path


def _letterboxed(size: int) -> torch.Tensor:
    """The photos, and the server's warm-up images (its start-up check judges on them), in
    ``size`` squares, as a YOLO model takes them (calibration only): scores spread on both."""
    from app.engine import warmup_images

    rows = []
    for data in (*photos()[::2], *warmup_images()):
        image = Image.open(io.BytesIO(data)).convert("RGB")
        scale = size / max(image.size)
        width, height = max(1, round(image.width * scale)), max(1, round(image.height * scale))
        canvas = Image.new("RGB", (size, size), (114, 114, 114))
        canvas.paste(image.resize((width, height)), ((size - width) // 2, (size - height) // 2))
        rows.append(torch.from_numpy(np.array(canvas)).permute(2, 0, 1).float() / 255)
    return torch.stack(rows)

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

SUFFIXES = {"detect": "", "pose": "-pose", "segment": "-seg", "classify": "-cls", "obb": "-obb"}
SIZES = {"classify": 224}


def checkpoint(task: str, folder: Path, name: str | None = None, family: str = "yolo11n") -> Path:
    """A checkpoint of ``family`` (``yolo11n``, ``yolo26n``…) for ``task`` with spread
    weights (made once per folder), saved as ``<name>.pt`` (by default
    ``<family>-<task>.pt``)."""
    path = folder / f"{name or f'{family}-{task}'}.pt"
    if not path.exists():
        from ultralytics import YOLO

        model = YOLO(f"{family}{SUFFIXES[task]}.yaml")
        batch = _letterboxed(SIZES.get(task, 640))
        spread(model.model, lambda module: module(batch), seed=0, sigmoid_confident=1e-4)
        model.save(str(path))
    return path


def torchscript(task: str, folder: Path, family: str = "yolo11n", end_to_end: bool = False) -> Path:
    """The checkpoint exported by Ultralytics to TorchScript (its metadata in ``config.txt``);
    ``end_to_end``: with its one-to-one head (``nms=False``), which answers without
    suppression."""
    source = checkpoint(task, folder, family=family)
    path = source.with_name(f"{source.stem}{'-e2e' if end_to_end else ''}.torchscript")
    if not path.exists():
        from ultralytics import YOLO

        # Tracing warns (deprecated; tensors read as Python values): Ultralytics' exporter.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options = {"nms": False} if end_to_end else {}
            exported = Path(YOLO(str(source)).export(
                format="torchscript", imgsz=SIZES.get(task, 640), verbose=False, **options
            ))  # fmt: skip
        exported.rename(path)
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

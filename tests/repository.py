"""Model repositories on disk for tests: small models, versions with their own weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import ColorClassifier

COMMON = {"weights": "none", "precision": "fp32", "max_batch_size": 8, "max_queue_delay_ms": 5}


def toml(values: dict[str, Any]) -> str:
    def render(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return f'"{value}"'
        if isinstance(value, list):
            return "[" + ", ".join(render(each) for each in value) + "]"
        return str(value)

    return "".join(f"{key} = {render(value)}\n" for key, value in values.items())


def add_model(root: Path, name: str, versions: tuple[int, ...] = (1,), **config: Any) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    # The torch backend unless a test names another: BACKEND=auto (the default) would export
    # the test models, whose Python side effects (counters, sleeps) the runtimes drop.
    (folder / "config.toml").write_text(toml({**COMMON, "backend": "torch", **config}))
    for version in versions:
        (folder / str(version)).mkdir(exist_ok=True)
    return folder


def add_version(root: Path, name: str, version: int, scale: float | None = None,
                **config: Any) -> Path:  # fmt: skip
    """A version folder; with ``scale``, its own weights (``model.pt``): the colour
    classifier's head scaled, so that its scores differ from version 1's."""
    folder = root / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    if scale is not None:
        model = ColorClassifier()
        with torch.no_grad():
            model.head.weight.mul_(scale)
        torch.save(model.state_dict(), folder / "model.pt")
    if config:
        (folder / "config.toml").write_text(toml(config))
    return folder


def colour_repository(root: Path) -> Path:
    """``colors`` (versions 1 and 2, latest served) and ``probe``, one version."""
    add_model(root, "colors", (1,), model="tests.models:color_classifier")
    add_version(root, "colors", 2, scale=-1.0)
    add_model(root, "probe", (1,), model="tests.models:overlap_probe", compile="none")
    return root

"""Engines for tests, built the way ``build_engine`` builds them."""

from __future__ import annotations

from typing import Any

import torch

from app.engine import InferenceEngine, TorchBackend, load_model
from tests.conftest import COLOR_MODEL


def torch_engine(
    model: str = COLOR_MODEL,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | None = None,
    compile_mode: str = "none",
    cuda_graphs: bool = False,
    **engine: Any,
) -> InferenceEngine:
    """An engine on the torch backend, built as ``build_engine`` builds it."""
    loaded = load_model(model, "none")
    crop = loaded.transform.crop_size
    backend = TorchBackend(
        loaded.module, device or torch.device("cpu"), dtype, (3, crop, crop),
        compile_mode=compile_mode, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    return InferenceEngine(loaded, backend, **engine)

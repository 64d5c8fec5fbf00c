"""The baseline users start from: a hand-written FastAPI endpoint, one image per forward pass.

Same model, precision and preprocessing as batchserve, no batching: each request is decoded
and run by itself in Starlette's thread pool. Start it with
``BATCHSERVE_MODEL=resnet18 uvicorn benchmarks.naive_app:app``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from app.engine import load_model, precision_candidates, resolve_device
from preprocessing import TransformConfig, normalize_into, prepare

_loaded = load_model(os.environ.get("BATCHSERVE_MODEL", "resnet18"), "none")
_device = resolve_device(os.environ.get("BATCHSERVE_DEVICE", "auto"))
# With "auto", the most accurate candidate: benchmarks pass an explicit precision.
_dtype = precision_candidates(os.environ.get("BATCHSERVE_PRECISION", "auto"), _device, False)[0]
_model = _loaded.module.to(device=_device, dtype=_dtype).to(memory_format=torch.channels_last)
_transform: TransformConfig = _loaded.transform

app = FastAPI(title="naive baseline")


def infer(data: bytes) -> dict[str, Any]:
    image = prepare(bytearray(data), _transform)
    assert image.pixels is not None
    batch = torch.empty(
        (1, *image.pixels.shape), dtype=_dtype, device=_device, memory_format=torch.channels_last
    )
    normalize_into([image.pixels], batch, _transform)
    with torch.inference_mode():
        scores, indices = torch.softmax(_model(batch).float(), dim=1).topk(5)
    return {
        "predictions": [
            {"index": i, "label": _loaded.labels[i], "score": s}
            for i, s in zip(indices[0].tolist(), scores[0].tolist(), strict=True)
        ]
    }


@app.post("/predict")
async def predict(request: Request) -> dict[str, Any]:
    return await run_in_threadpool(infer, await request.body())

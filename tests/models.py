"""Small deterministic models for tests: no downloads, outputs that really depend on the input."""

from __future__ import annotations

import time

import torch
from torch import nn

NUM_COLOR_CLASSES = 12


class ColorClassifier(nn.Module):
    """Classifies an image by its mean colour and brightness pattern.

    Global average pooling of the normalized input over a 2x2 grid gives 12 numbers; a fixed,
    well-conditioned linear map turns them into 12 logits. Different images get clearly
    different scores, so a result delivered to the wrong request is easy to spot.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(12, NUM_COLOR_CLASSES)
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(NUM_COLOR_CLASSES, 12, generator=generator) * 2)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(torch.flatten(self.pool(x), 1))
        return logits


def color_classifier() -> nn.Module:
    return ColorClassifier()


class Exploding(nn.Module):
    """Raises on demand: ``Exploding.fail_next`` batches fail, then it behaves like its base."""

    fail_next = 0

    def __init__(self) -> None:
        super().__init__()
        self.base = ColorClassifier()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Exploding.fail_next > 0:
            Exploding.fail_next -= 1
            raise RuntimeError("injected failure")
        logits: torch.Tensor = self.base(x)
        return logits


def exploding() -> nn.Module:
    return Exploding()


class Slow(nn.Module):
    """Takes ``Slow.seconds`` per forward pass, like a big model on a small machine.

    Zero by default so that loading and warm-up stay fast; tests raise it once serving.
    Serve it with ``COMPILE=none``: tracing keeps tensor operations only, not the sleep.
    """

    seconds = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.base = ColorClassifier()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Slow.seconds > 0:
            time.sleep(Slow.seconds)
        logits: torch.Tensor = self.base(x)
        return logits


def slow() -> nn.Module:
    return Slow()


def slow_from_env() -> nn.Module:
    """A ``Slow`` model, its delay from ``BATCHSERVE_TEST_SLOW_SECONDS`` (for subprocesses)."""
    import os

    Slow.seconds = float(os.environ.get("BATCHSERVE_TEST_SLOW_SECONDS", "0"))
    return Slow()


class Untraceable(ColorClassifier):
    """Refuses to be traced, like a model with Python-side logic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]
            raise RuntimeError("this model cannot be traced")
        return super().forward(x)


class TracesDifferently(ColorClassifier):
    """Gives other answers once traced: the check against eager must catch it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        tracing = torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        return logits * 3 if tracing else logits

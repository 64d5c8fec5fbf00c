"""torchvision's detection and segmentation models, and its classifiers as encoders, made to
take the server's batch: a normalised, letterboxed ``float[N, 3, S, S]``.

A torchvision detector (Faster R-CNN, RetinaNet, FCOS, SSD, SSDlite, Mask R-CNN) brings its
own input transform: it normalises each image with ImageNet's statistics and resizes it to
its ``min_size`` (800 px for Faster R-CNN). Served here, its transform is set to the size the
server already letterboxed to and to identity statistics (the server normalises with the
model's own: ImageNet's, or SSDlite's 0.5 and 0.5), so that it neither resizes nor normalises
again; its boxes come back in the input's
pixels, which the server maps to the original image's. It runs its own non-maximum
suppression. Its output (a list of dicts, with data-dependent sizes) cannot be traced or
captured in a CUDA graph, so it runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from app.engine.tasks.outputs import segmentation


class TorchvisionDetector(nn.Module):
    """A torchvision detector taking the server's ``[N, 3, size, size]`` batch."""

    def __init__(self, model: nn.Module, size: int) -> None:
        super().__init__()
        transform: Any = model.transform  # GeneralizedRCNNTransform
        # The statistics it was trained with (ImageNet's, or SSDlite's 0.5 and 0.5): the
        # server normalises with them (``statistics``), so the model must not again.
        self.statistics = (tuple(transform.image_mean), tuple(transform.image_std))
        transform.image_mean = [0.0, 0.0, 0.0]
        transform.image_std = [1.0, 1.0, 1.0]
        transform.min_size = (size,)
        transform.max_size = size
        if getattr(transform, "fixed_size", None) is not None:  # SSD, SSDlite
            transform.fixed_size = (size, size)
        self.model = model

    def forward(self, batch: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        detected: list[dict[str, torch.Tensor]] = self.model(list(batch))
        return detected


class SegmenterLogits(nn.Module):
    """A segmenter's logits alone: torchvision's (and any model's) ``{"out": logits, ...}``
    reduced to its ``out`` (an auxiliary head's are not served), so that every segmenter
    returns one tensor and can be traced like a classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return segmentation(self.model(batch))


def without_head(module: nn.Module, name: str) -> nn.Module:
    """A classifier as an encoder: its last linear layer (the classifier head) replaced by the
    identity, so that it returns its penultimate features."""
    last: tuple[nn.Module, str] | None = None
    for parent in module.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                last = (parent, child_name)
    if last is None:
        raise ValueError(
            f"{name} has no linear classifier head to remove: give TASK=embed a model that "
            f"returns its features (package.module:factory)"
        )
    setattr(last[0], last[1], nn.Identity())
    return module

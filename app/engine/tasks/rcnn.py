"""A two-stage torchvision detector (Faster R-CNN, Mask R-CNN) in two parts, so that an
inference runtime can run the part of it with fixed shapes.

Its region proposals and their pooling have data-dependent shapes, but its backbone and
feature pyramid do not: ``RcnnGraph`` is that part, ``[N, 3, S, S]`` to one feature map per
level, for a runtime. ``RcnnDecode`` is the rest, in PyTorch on what the graph returns: the
region proposals, the pooling of their features, the box head and its suppression, as the
model runs them (``benchmarks/studies/rcnn_split/``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.functional import pad

from app.engine.tasks.outputs import Detections, detections


def two_stage(model: Any) -> bool:
    """Whether ``model`` is torchvision's two-stage detector (region proposals, then heads)."""
    return all(hasattr(model, part) for part in ("backbone", "rpn", "roi_heads"))


class RcnnGraph(nn.Module):
    """The backbone and feature pyramid of a two-stage detector, on the server's batch padded
    as the detector's transform pads it: ``batch [N, 3, S, S]`` to its feature maps."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.backbone = model.backbone
        self.size_divisible = int(getattr(model.transform, "size_divisible", 1))

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        height, width = batch.shape[-2:]
        bottom, right = -height % self.size_divisible, -width % self.size_divisible
        if bottom or right:
            batch = pad(batch, (0, right, 0, bottom))
        features = self.backbone(batch.contiguous(memory_format=torch.channels_last))
        return tuple(features.values())


class RcnnDecode:
    """The rest of a two-stage detector on the graph's feature maps, for inputs of one
    ``size``: proposals, pooled features, box head, suppression; padded detections."""

    # Most of the model's arithmetic (the box head's dense layers on every proposal): torch
    # computes it with every thread, not the one it keeps beside a runtime's forward pass.
    torch_heavy = True

    def __init__(self, model: Any, size: tuple[int, int]) -> None:
        self.model = model
        self.size = size
        divisible = int(getattr(model.transform, "size_divisible", 1))
        self.padded = tuple(side + (-side % divisible) for side in size)
        first = next(model.parameters())
        with torch.inference_mode():
            blank = torch.zeros((1, 3, *self.padded), device=first.device)
            self.levels = tuple(model.backbone(blank).keys())

    def __call__(self, outputs: Sequence[torch.Tensor]) -> Detections:
        from torchvision.models.detection.image_list import ImageList

        # channels_last, as the backbone makes them in PyTorch: the heads' convolutions and
        # the RoI pooling run faster on them.
        maps = [each.contiguous(memory_format=torch.channels_last) for each in outputs]
        features = OrderedDict(zip(self.levels, maps, strict=True))
        # The anchors need the padded batch's shape alone: a view of one zero, not its pixels.
        shape = maps[0].new_zeros(()).expand(maps[0].shape[0], 3, *self.padded)
        images = ImageList(shape, [self.size] * maps[0].shape[0])
        proposals, _ = self.model.rpn(images, features)
        found, _ = self.model.roi_heads(features, proposals, images.image_sizes)
        return detections(found)

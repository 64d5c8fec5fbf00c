"""A one-stage torchvision detector with anchors on every level of a feature pyramid
(RetinaNet, FCOS) in two parts, as SSD is served (``tasks.ssd``).

``DenseGraph`` is its backbone, feature pyramid and heads on the server's batch: fixed
arithmetic, for a runtime, answering the heads' outputs for every anchor of every level
(``cls_logits``, ``bbox_regression``, and FCOS's ``bbox_ctrness``). ``DenseDecode`` is the
rest, in PyTorch, as the model runs it: its anchors (made once per canvas: they follow the
input's and the feature maps' sizes, not the pixels), the outputs split by level, and the
model's own ``postprocess_detections`` (per level, the best candidates above its score
threshold, decoded and clipped to the image's own size; per image, the suppression).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from app.engine.tasks.outputs import Detections, detections
from app.engine.tasks.rcnn import RcnnGraph


def dense(model: Any) -> bool:
    """Whether ``model`` is torchvision's RetinaNet or FCOS (heads on every pyramid level,
    anchors decoded by the model's ``postprocess_detections``)."""
    return type(model).__name__ in ("RetinaNet", "FCOS") and hasattr(model, "anchor_generator")


def head_outputs(model: Any) -> tuple[str, ...]:
    """The names of the heads' outputs, in the graph's order."""
    if type(model).__name__ == "FCOS":
        return ("cls_logits", "bbox_regression", "bbox_ctrness")
    return ("cls_logits", "bbox_regression")


class DenseGraph(nn.Module):
    """The backbone, pyramid and heads of a RetinaNet or FCOS: ``batch [N, 3, S, S]`` to each
    head's output ``[N, anchors, ...]`` over every level, in ``head_outputs`` order."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.pyramid = RcnnGraph(model)  # a two-stage detector's pyramid
        self.head = model.head
        self.names = head_outputs(model)

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        answered = self.head(list(self.pyramid(batch)))
        return tuple(answered[name] for name in self.names)


class DenseDecode:
    """The rest of a RetinaNet or FCOS on the graph's outputs, for inputs of one ``canvas``:
    anchors, the split by level, the model's ``postprocess_detections``; padded detections."""

    def __init__(self, model: Any, canvas: tuple[int, int]) -> None:
        from torchvision.models.detection.image_list import ImageList

        self.model = model
        self.names = head_outputs(model)
        device = next(model.parameters()).device
        with torch.inference_mode():
            blank = torch.zeros((1, 3, *canvas), device=device)
            features = list(model.backbone(blank).values())
            (self.anchors,) = model.anchor_generator(ImageList(blank, [canvas]), features)
        places = [each.shape[2] * each.shape[3] for each in features]
        per_place = len(self.anchors) // sum(places)  # anchors per place: RetinaNet's 9, FCOS's 1
        self.per_level = [count * per_place for count in places]

    def __call__(
        self, outputs: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]]
    ) -> Detections:
        images = outputs[0].shape[0]
        split = {name: list(torch.split(each, self.per_level, dim=1))
                 for name, each in zip(self.names, outputs, strict=True)}  # fmt: skip
        anchors = list(torch.split(self.anchors.to(outputs[0].device), self.per_level))
        found = self.model.postprocess_detections(split, [anchors] * images,
                                                  [(int(h), int(w)) for h, w in sizes])  # fmt: skip
        return detections(found)

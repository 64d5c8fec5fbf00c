"""A two-stage torchvision detector (Faster R-CNN, Mask R-CNN) in parts, so that an inference
runtime can run the parts of it whose shapes follow from their inputs'.

Its region proposals and the suppression of its boxes have data-dependent shapes, but its
backbone and feature pyramid do not: ``RcnnGraph`` is that part, ``[N, 3, S, S]`` to one
feature map per level, for a runtime. ``RcnnDecode`` is the rest, in PyTorch on what the graph
returns: the region proposals, the pooling of their features, the box head and its
suppression, as the model runs them (``benchmarks/studies/rcnn_split/``).

Given the proposals, the RoI pooling, the box head's dense layers and its class and box
predictors are a second graph of fixed shapes but for the number of proposals,
``RcnnBoxHead``: most of a small detector's arithmetic. ``RcnnDecode`` runs it on the runtime
that ran the backbone when it is given one (``with_box_head``): served so, an image of Faster
R-CNN MobileNetV3 320 took 27-33 ms on ONNX Runtime where PyTorch's part alone took 61-64 on a
2-core AMD EPYC (``benchmarks/studies/rcnn_split/``). Mask R-CNN is served without its mask
branch (``adapters.TorchvisionDetector``): it is a Faster R-CNN here.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.functional import pad

from app.engine.tasks.outputs import Detections, detections


def two_stage(model: Any) -> bool:
    """Whether ``model`` is torchvision's two-stage detector (region proposals, then heads)."""
    return all(hasattr(model, part) for part in ("backbone", "rpn", "roi_heads"))


def padded_size(model: Any, size: tuple[int, int]) -> tuple[int, ...]:
    """``size`` padded as the detector's transform pads a batch: to its ``size_divisible``."""
    divisible = int(getattr(model.transform, "size_divisible", 1))
    return tuple(side + (-side % divisible) for side in size)


class RcnnGraph(nn.Module):
    """The backbone and feature pyramid of a two-stage detector (or of RetinaNet's and FCOS's,
    ``tasks.dense``), on the server's batch padded as the detector's transform pads it:
    ``batch [N, 3, S, S]`` to its feature maps."""

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


# A box head on a runtime: the proposals ``[R, 5]`` (image index, x1, y1, x2, y2) and the
# graph's feature maps in, each proposal's class logits and box offsets out.
BoxHeadRun = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]

BOX_HEAD_INPUTS = ("rois",)
BOX_HEAD_OUTPUTS = ("class_logits", "box_regression")


class RcnnDecode:
    """The rest of a two-stage detector on the graph's feature maps, for inputs of one
    ``size``: proposals, pooled features, box head, suppression; padded detections.
    ``box_head``: the box head on a runtime (``RcnnBoxHead``), else PyTorch runs it."""

    def __init__(self, model: Any, size: tuple[int, int]) -> None:
        self.model = model
        self.size = size
        self.padded = padded_size(model, size)
        first = next(model.parameters())
        with torch.inference_mode():
            blank = torch.zeros((1, 3, *self.padded), device=first.device)
            features = model.backbone(blank)
            # The pooler infers each level's scale from its first call: made here, so that
            # the box head's graph and PyTorch pool with the same ones.
            model.roi_heads.box_roi_pool(features, [blank.new_zeros((1, 4))], [size])
        self.levels = tuple(features.keys())
        self.box_head: BoxHeadRun | None = None

    @property
    def torch_heavy(self) -> bool:
        """Whether torch computes most of the model's arithmetic (the box head's dense layers
        on every proposal), so that it wants every thread, not the one it keeps beside a
        runtime's forward pass."""
        return self.box_head is None

    def with_box_head(self, run: BoxHeadRun) -> RcnnDecode:
        """This decoding with the box head run by ``run``."""
        decode = copy.copy(self)
        decode.box_head = run
        return decode

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
        if self.box_head is None:
            found, _ = self.model.roi_heads(features, proposals, images.image_sizes)
            return detections(found)
        return self._boxes_of(proposals, outputs, images.image_sizes)

    def _boxes_of(
        self,
        proposals: list[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        sizes: list[tuple[int, int]],
    ) -> Detections:
        """What ``roi_heads`` answers, with the box head on the runtime."""
        assert self.box_head is not None
        heads = self.model.roi_heads
        rois = torch.cat([
            torch.cat([torch.full_like(boxes[:, :1], index), boxes], dim=1)
            for index, boxes in enumerate(proposals)
        ])  # fmt: skip
        if len(rois) == 0:  # nothing proposed: nothing for the graph, whose axis starts at 1
            width = heads.box_predictor.cls_score.out_features
            class_logits, box_regression = (
                rois.new_zeros((0, width)),
                rois.new_zeros((0, 4 * width)),
            )
        else:
            class_logits, box_regression = self.box_head([rois, *outputs])
        boxes, scores, labels = heads.postprocess_detections(
            class_logits, box_regression, proposals, sizes
        )
        found = [
            {"boxes": each_boxes, "scores": each_scores, "labels": each_labels}
            for each_boxes, each_scores, each_labels in zip(boxes, scores, labels, strict=True)
        ]
        return detections(found)


class RcnnBoxHead(nn.Module):
    """A two-stage detector's RoI pooling, box head and predictors as a graph for a runtime:
    ``(rois [R, 5], *feature maps)`` to ``(class_logits [R, classes], box_regression [R, 4 *
    classes])``, as ``roi_heads`` computes them. Each proposal is pooled from the level its
    size maps to, as ``MultiScaleRoIAlign`` pools them: where sizes map to several levels, each
    proposal is pooled from every level and its own level's kept (fixed shapes, at the cost of
    pooling once per level); where every size maps to one level (the MobileNetV3 320 pyramid's
    two maps have one stride), from that one alone."""

    def __init__(self, model: Any, decode: RcnnDecode) -> None:
        super().__init__()
        heads = model.roi_heads
        pooler = heads.box_roi_pool
        self.head = heads.box_head
        self.predictor = heads.box_predictor
        # The levels it pools from: those of its names the backbone makes, in its order.
        self.maps = [decode.levels.index(name) for name in pooler.featmap_names
                     if name in decode.levels]  # fmt: skip
        self.scales = [float(scale) for scale in pooler.scales]
        self.mapper = pooler.map_levels
        self.output_size = tuple(pooler.output_size)
        self.sampling_ratio = int(pooler.sampling_ratio)
        if len(self.maps) > 1 and self.mapper.k_min == self.mapper.k_max:
            self.maps, self.scales = self.maps[:1], self.scales[:1]

    def forward(self, rois: torch.Tensor, *features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        maps = [features[index] for index in self.maps]
        if len(maps) == 1:
            pooled = self._pool(maps[0], rois, self.scales[0])
        else:
            level = self.mapper([rois[:, 1:]])
            pooled = rois.new_zeros((rois.shape[0], maps[0].shape[1], *self.output_size))
            for index, (each, scale) in enumerate(zip(maps, self.scales, strict=True)):
                chosen = level == index
                pooled = torch.where(chosen[:, None, None, None], self._pool(each, rois, scale),
                                     pooled)  # fmt: skip
        class_logits, box_regression = self.predictor(self.head(pooled))
        return class_logits, box_regression

    def _pool(self, features: torch.Tensor, rois: torch.Tensor, scale: float) -> torch.Tensor:
        from torchvision.ops import roi_align  # torchvision only where a detector is served

        pooled: torch.Tensor = roi_align(features, rois, self.output_size, scale,
                                         self.sampling_ratio, False)  # fmt: skip
        return pooled

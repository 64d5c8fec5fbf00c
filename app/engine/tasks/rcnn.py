"""A two-stage torchvision detector (Faster R-CNN, Mask R-CNN, Keypoint R-CNN) in parts, so
that an inference runtime can run the parts of it whose shapes follow from their inputs'.

Its region proposals and the suppression of its boxes have data-dependent shapes, but its
backbone and feature pyramid do not: ``RcnnGraph`` is that part, ``[N, 3, H, W]`` to one
feature map per level, for a runtime. ``RcnnDecode`` is the rest, in PyTorch on what the graph
returns, each image told its own size: the region proposals, the pooling of their features,
the box head and its suppression, then Mask R-CNN's mask head and Keypoint R-CNN's keypoint
head on the boxes found, as the model runs them (``benchmarks/studies/rcnn_split/``).

Given the proposals, the box head's dense layers and its class and box predictors are a
second graph of fixed shapes but for the number of proposals, ``RcnnBoxHead``: most of a small
detector's arithmetic. ``RcnnDecode`` runs it on the runtime that ran the backbone when it is
given one (``with_box_head``), on the proposals' features pooled here by matrix products
(``roi_pool``: a fifth of the time ONNX Runtime's RoIAlign took). Served so, an image of
Faster R-CNN MobileNetV3 320 took 27-33 ms on ONNX Runtime where PyTorch's part alone took
61-64 on a 2-core AMD EPYC (``benchmarks/studies/rcnn_split/``, with the runtime's pooling).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.functional import linear

from app.engine.tasks.outputs import Detections, detections
from app.engine.tasks.roi_pool import LevelPooling


def two_stage(model: Any) -> bool:
    """Whether ``model`` is torchvision's two-stage detector (region proposals, then heads)."""
    return all(hasattr(model, part) for part in ("backbone", "rpn", "roi_heads"))


class RcnnGraph(nn.Module):
    """The backbone and feature pyramid of a two-stage detector (or of RetinaNet's and FCOS's,
    ``tasks.dense``), on the server's batch, padded as the detector's transform pads it:
    ``batch [N, 3, H, W]`` to its feature maps."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.backbone = model.backbone

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = self.backbone(batch.contiguous(memory_format=torch.channels_last))
        return tuple(features.values())


# A box head on a runtime: each proposal's pooled features ``[R, bins, C]`` in, its class
# logits and box offsets out.
BoxHeadRun = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]

BOX_HEAD_INPUTS = ("pooled",)
BOX_HEAD_OUTPUTS = ("class_logits", "box_regression")


class RcnnDecode:
    """The rest of a two-stage detector on the graph's feature maps, for inputs of one
    ``canvas``: proposals, pooled features, box head, suppression, and the mask or keypoint
    head; padded detections. ``box_head``: the box head on a runtime (``RcnnBoxHead``), else
    PyTorch runs it."""

    def __init__(self, model: Any, canvas: tuple[int, int]) -> None:
        self.model = model
        self.canvas = canvas
        first = next(model.parameters())
        with torch.inference_mode():
            blank = torch.zeros((1, 3, *canvas), device=first.device)
            features = model.backbone(blank)
            # The poolers infer each level's scale from their first call: made here, so that
            # the box head's graph and PyTorch pool with the same ones.
            for pooler in poolers(model.roi_heads):
                pooler(features, [blank.new_zeros((1, 4))], [canvas])
        self.levels = tuple(features.keys())
        self.pooling = level_pooling(model, self.levels)
        # What the box head takes of each proposal: [bins, channels of the maps it pools].
        first_map = features[self.levels[self.pooling.maps[0]]]
        bins = self.pooling.output_size[0] * self.pooling.output_size[1]
        self.pooled_shape = (bins, int(first_map.shape[1]))
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

    @staticmethod
    def levels_of(model: Any) -> tuple[str, ...]:
        """The names of the backbone's feature maps, in order."""
        first = next(model.parameters())
        with torch.inference_mode():
            return tuple(model.backbone(torch.zeros((1, 3, 128, 128), device=first.device)))

    def __call__(
        self, outputs: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]]
    ) -> Detections:
        from torchvision.models.detection.image_list import ImageList

        # channels_last, as the backbone makes them in PyTorch: the heads' convolutions and
        # the RoI pooling run faster on them.
        maps = [each.contiguous(memory_format=torch.channels_last) for each in outputs]
        features = OrderedDict(zip(self.levels, maps, strict=True))
        # The anchors need the padded batch's shape alone: a view of one zero, not its pixels.
        shape = maps[0].new_zeros(()).expand(maps[0].shape[0], 3, *self.canvas)
        images = ImageList(shape, [(int(h), int(w)) for h, w in sizes])
        proposals, _ = self.model.rpn(images, features)
        if self.box_head is None:
            found, _ = self.model.roi_heads(features, proposals, images.image_sizes)
            return detections(found)
        return self._boxes_of(proposals, features, images.image_sizes)

    def _boxes_of(
        self,
        proposals: list[torch.Tensor],
        features: OrderedDict[str, torch.Tensor],
        sizes: list[tuple[int, int]],
    ) -> Detections:
        """What ``roi_heads`` answers, its pooling here and its box head on the runtime; its
        mask or keypoint head, where it has one, in PyTorch on the boxes found."""
        assert self.box_head is not None
        heads = self.model.roi_heads
        maps = list(features.values())
        # Nothing proposed: nothing for the graph, whose axis starts at 1.
        if sum(len(boxes) for boxes in proposals) == 0:
            width = heads.box_predictor.cls_score.out_features
            class_logits, box_regression = (
                maps[0].new_zeros((0, width)),
                maps[0].new_zeros((0, 4 * width)),
            )
        else:
            pooled = self.pooling(maps, proposals)
            class_logits, box_regression = self.box_head([pooled])
        boxes, scores, labels = heads.postprocess_detections(
            class_logits, box_regression, proposals, sizes
        )
        found = [
            {"boxes": each_boxes, "scores": each_scores, "labels": each_labels}
            for each_boxes, each_scores, each_labels in zip(boxes, scores, labels, strict=True)
        ]
        instance_heads(heads, features, found, sizes)
        return detections(found)


def poolers(heads: Any) -> list[Any]:
    """The RoI poolers of ``roi_heads``: the boxes', and the masks' or keypoints' where the
    model has them."""
    found = [heads.box_roi_pool]
    if heads.has_mask():
        found.append(heads.mask_roi_pool)
    if heads.has_keypoint():
        found.append(heads.keypoint_roi_pool)
    return found


def instance_heads(
    heads: Any,
    features: OrderedDict[str, torch.Tensor],
    found: list[dict[str, torch.Tensor]],
    sizes: list[tuple[int, int]],
) -> None:
    """Mask R-CNN's masks and Keypoint R-CNN's keypoints of the boxes ``found``, added to
    each image's answer as ``roi_heads`` adds them in evaluation (its own heads and
    inference functions, on the boxes it answered)."""
    from torchvision.models.detection.roi_heads import keypointrcnn_inference, maskrcnn_inference

    boxes = [each["boxes"] for each in found]
    labels = [each["labels"] for each in found]
    if heads.has_mask():
        pooled = heads.mask_roi_pool(features, boxes, sizes)
        logits = heads.mask_predictor(heads.mask_head(pooled))
        for each, masks in zip(found, maskrcnn_inference(logits, labels), strict=True):
            each["masks"] = masks
    if heads.has_keypoint():
        pooled = heads.keypoint_roi_pool(features, boxes, sizes)
        logits = heads.keypoint_predictor(heads.keypoint_head(pooled))
        points, scores = keypointrcnn_inference(logits, boxes)
        for each, kept, score in zip(found, points, scores, strict=True):
            each["keypoints"], each["keypoints_scores"] = kept, score


def level_pooling(model: Any, levels: tuple[str, ...]) -> LevelPooling:
    """The model's ``MultiScaleRoIAlign`` as ``LevelPooling`` over the graph's feature maps
    (named ``levels``): from the levels it pools, in its order, or from the first alone where
    every size maps to one level (the MobileNetV3 320 pyramid's two maps have one stride)."""
    pooler = model.roi_heads.box_roi_pool
    maps = [levels.index(name) for name in pooler.featmap_names if name in levels]
    scales = [float(scale) for scale in pooler.scales]
    mapper = pooler.map_levels
    if len(maps) > 1 and mapper.k_min == mapper.k_max:
        maps, scales = maps[:1], scales[:1]
    return LevelPooling(maps, scales, mapper, tuple(pooler.output_size),
                        int(pooler.sampling_ratio))  # fmt: skip


class RcnnBoxHead(nn.Module):
    """A two-stage detector's box head and predictors as a graph for a runtime: ``pooled
    [R, bins, C]`` (``LevelPooling``'s, bins before channels) to ``(class_logits [R,
    classes], box_regression [R, 4 * classes])``, as ``roi_heads`` computes them from its
    pooling. torchvision's two dense layers (``TwoMLPHead``) take the pooled features as they
    are, the first layer's columns put in their order; another head gets them channels
    first."""

    def __init__(self, model: Any) -> None:
        from torchvision.models.detection.faster_rcnn import TwoMLPHead

        super().__init__()
        heads = model.roi_heads
        self.predictor = heads.box_predictor
        self.output_size = tuple(heads.box_roi_pool.output_size)
        bins = self.output_size[0] * self.output_size[1]
        # ``TwoMLPHead``'s first layer with its columns in the pooled features' order (its
        # bias as it is), then the rest of the head; or another head whole.
        self.first: nn.Parameter | None = None
        self.first_bias: torch.Tensor | None = None
        self.rest: nn.Module = heads.box_head
        if isinstance(heads.box_head, TwoMLPHead):
            fc6 = heads.box_head.fc6
            columns = fc6.weight.detach().reshape(fc6.out_features, -1, bins).transpose(1, 2)
            self.first = nn.Parameter(columns.reshape(fc6.out_features, -1), requires_grad=False)
            self.first_bias = fc6.bias
            self.rest = heads.box_head.fc7

    def forward(self, pooled: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first is not None:
            hidden = torch.relu(linear(pooled.flatten(1), self.first, self.first_bias))
            features = torch.relu(self.rest(hidden))
        else:
            channels_first = pooled.transpose(1, 2).reshape(len(pooled), -1, *self.output_size)
            features = self.rest(channels_first)
        class_logits, box_regression = self.predictor(features)
        return class_logits, box_regression

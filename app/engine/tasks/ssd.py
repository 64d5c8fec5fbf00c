"""SSD's and SSDlite's detections for the whole batch at once.

torchvision's ``SSD.postprocess_detections`` loops in Python over the images and, in each,
over every class (90 for COCO): a score threshold, a top-k and three index operations per
class and image, 720 small steps for a batch of eight, then suppresses every candidate left
(up to 27,000 an image). The same answer in a few tensor operations: every class's top-k
anchors of every image at once (the top k of the scores above the threshold are exactly the
scores above the threshold among the top k), each image's candidates above the threshold
taken by one mask, then its suppression among its best candidates only (``best_survivors``),
padded into ``(boxes, scores, labels)``.

The model is served in two parts: ``SsdGraph`` (backbone and heads: fixed shapes, the part an
inference runtime can run) and ``SsdDecode`` (anchors, box decoding, the detections above),
in PyTorch on whatever the graph returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.functional import softmax

from app.engine.tasks.outputs import Detections


class SsdGraph(nn.Module):
    """What of a torchvision SSD runs as one graph, on PyTorch or exported to a runtime: the
    backbone and the heads, ``batch [N, 3, S, S]`` (every image stretched to its fixed size)
    to ``(bbox_regression [N, A, 4], cls_logits [N, A, C])``; its anchors depend on the
    input's size alone (``SsdDecode``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.backbone = model.backbone
        self.head = model.head

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(batch.contiguous(memory_format=torch.channels_last))
        features = list(features.values()) if isinstance(features, dict) else [features]
        head = self.head(features)
        return head["bbox_regression"], head["cls_logits"]


class SsdDecode:
    """The rest of a torchvision SSD on the graph's outputs, for inputs of one ``size``: its
    anchors (made once: they follow the size of the input and of its feature maps, not the
    pixels), box decoding and ``batched_detections``."""

    def __init__(self, model: Any, size: tuple[int, int]) -> None:
        from torchvision.models.detection.image_list import ImageList

        self.box_coder = model.box_coder
        self.size = size
        self.options = {
            "score_thresh": model.score_thresh, "topk": model.topk_candidates,
            "nms_thresh": model.nms_thresh, "per_image": model.detections_per_img,
        }  # fmt: skip
        device = next(model.parameters()).device
        with torch.inference_mode():
            blank = torch.zeros((1, 3, *size), device=device)
            features = model.backbone(blank)
            features = list(features.values()) if isinstance(features, dict) else [features]
            (self.anchors,) = model.anchor_generator(ImageList(blank, [size]), features)

    def __call__(
        self, outputs: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]] = ()
    ) -> Detections:
        """The detections of the batch; every image fills the input (``sizes`` are its size)."""
        regression, logits = outputs
        anchors = self.anchors.to(regression.device).expand(regression.shape[0], -1, -1)
        return batched_detections(regression, logits, anchors, self.box_coder, self.size,
                                  **self.options)  # fmt: skip


def batched_detections(
    regression: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.Tensor,
    box_coder: Any,
    size: tuple[int, int],
    *,
    score_thresh: float,
    topk: int,
    nms_thresh: float,
    per_image: int,
) -> Detections:
    """``regression [N, A, 4]``, ``logits [N, A, C]`` (class 0 the background) and
    ``anchors [N, A, 4]`` of images of one ``size`` (height, width) to padded detections,
    best first in each image."""
    from torchvision.ops import clip_boxes_to_image

    n, count, _ = regression.shape
    boxes = box_coder.decode_single(regression.reshape(-1, 4), anchors.reshape(-1, 4))
    boxes = clip_boxes_to_image(boxes, size).reshape(n, count, 4)
    scores = softmax(logits, dim=-1)[:, :, 1:]  # [N, A, C - 1]
    classes = scores.shape[2]
    top, anchor = scores.topk(min(topk, count), dim=1)  # [N, k, C - 1]: per image and class
    top, anchor = top.reshape(n, -1), anchor.reshape(n, -1)  # each image's candidates
    label = torch.arange(1, classes + 1, device=boxes.device).repeat(top.shape[1] // classes)
    found = []
    for each in range(n):
        score = top[each]
        kept = score > score_thresh
        # Indices only where some fall below: random weights keep every one of 27,000.
        chosen = None if bool(kept.all()) else kept.nonzero().squeeze(1)
        if chosen is not None:
            score = score[chosen]
        mine = anchor[each] if chosen is None else anchor[each, chosen]
        labels = label if chosen is None else label[chosen]
        box = boxes[each, mine]
        survivors = best_survivors(box, score, labels, nms_thresh, per_image)
        found.append((box[survivors], score[survivors], labels[survivors]))
    width = max(1, *(len(score) for _, score, _ in found))
    out_boxes = boxes.new_zeros((n, width, 4))
    out_scores = scores.new_zeros((n, width))
    out_labels = torch.zeros((n, width), dtype=torch.int64, device=boxes.device)
    for each, (box, score, labels) in enumerate(found):
        out_boxes[each, : len(score)] = box
        out_scores[each, : len(score)] = score
        out_labels[each, : len(score)] = labels
    return Detections(out_boxes, out_scores, out_labels)


def best_survivors(
    boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, iou: float, keep: int
) -> torch.Tensor:
    """``batched_nms(boxes, scores, labels, iou)[:keep]``, found among the best candidates
    only. Suppression takes each class's boxes best first, so whether a box survives depends
    on the better boxes of its class alone: once the best ``m`` candidates leave ``keep``
    survivors, no later candidate can be among the first ``keep``. A random-weight SSDlite
    scores every anchor of every class alike, 27,000 candidates an image; a trained one still
    has thousands above its threshold of 0.001 (equal scores may come out in another order)."""
    from torchvision.ops import nms

    order = scores.argsort(descending=True)
    head = 2 * keep
    while True:
        best = order[:head]
        # Per class in one call: each class's boxes moved apart from the others' (what
        # ``batched_nms`` does for up to a thousand boxes on a CPU; beyond, it calls ``nms``
        # once per class, 90 times for COCO).
        box = boxes[best]
        apart = box + (labels[best] * (box.max() + 1)).to(box.dtype)[:, None] if len(box) else box
        survivors = best[nms(apart, scores[best], iou)]
        if len(survivors) >= keep or head >= len(order):
            return survivors[:keep]
        head *= 4

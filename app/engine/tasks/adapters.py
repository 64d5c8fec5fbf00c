"""torchvision's detection and segmentation models, and its classifiers as encoders, made to
take the server's batch: a normalised, letterboxed ``float[N, 3, S, S]``.

A torchvision detector (Faster R-CNN, RetinaNet, FCOS, SSD, SSDlite, Mask R-CNN) brings its
own input transform: it normalises each image with ImageNet's statistics and resizes it to
its ``min_size`` (800 px for Faster R-CNN), one image at a time. Served here, the server
normalises with the model's own statistics (ImageNet's, or SSDlite's 0.5 and 0.5) and
letterboxes to the served size, and the transform is replaced by ``ServedBatch``, which takes
the batch as it is; its boxes come back in the input's pixels, which the server maps to the
original image's. It runs its own non-maximum suppression. Its output (a list of dicts, with
data-dependent sizes) cannot be traced or captured in a CUDA graph, so it runs eagerly.
Mask R-CNN is served as the detector it is: its boxes, without its mask branch (four
convolutions on every detection's pooled features, then each mask pasted into the image),
whose masks a detector's answer does not carry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.functional import pad

from app.engine.tasks.dense import DenseDecode, DenseGraph, dense, head_outputs
from app.engine.tasks.outputs import Detections, segmentation
from app.engine.tasks.rcnn import RcnnBoxHead, RcnnDecode, RcnnGraph, two_stage
from app.engine.tasks.ssd import SsdDecode, SsdGraph


class TorchvisionDetector(nn.Module):
    """A torchvision detector taking the server's ``[N, 3, size, size]`` batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        transform: Any = model.transform  # GeneralizedRCNNTransform
        # The statistics it was trained with (ImageNet's, or SSDlite's 0.5 and 0.5): the
        # server normalises with them (``statistics``), so the model must not again.
        self.statistics = (tuple(transform.image_mean), tuple(transform.image_std))
        model.transform = ServedBatch(transform)
        roi_heads: Any = getattr(model, "roi_heads", None)
        if roi_heads is not None and roi_heads.has_mask():  # Mask R-CNN: boxes are answered
            roi_heads.mask_roi_pool = roi_heads.mask_head = roi_heads.mask_predictor = None
        self.model = model
        # SSD and SSDlite: in two parts, their detections taken for the batch at once.
        self.batched = type(model).__name__ == "SSD"
        self._decoders: dict[tuple[int, int], SsdDecode | RcnnDecode | DenseDecode] = {}

    def forward(self, batch: torch.Tensor) -> list[dict[str, torch.Tensor]] | Detections:
        if self.batched:
            size = (int(batch.shape[-2]), int(batch.shape[-1]))
            return self.decoder(size)(SsdGraph(self.model)(batch))
        detected: list[dict[str, torch.Tensor]] = self.model(list(batch))
        return detected

    def decoder(self, size: tuple[int, int]) -> SsdDecode | RcnnDecode | DenseDecode:
        """What PyTorch runs of the detector on its graph's outputs for inputs of ``size``,
        made once per size (SSD's, RetinaNet's and FCOS's anchors, a two-stage detector's
        feature levels)."""
        if size not in self._decoders:
            decode: type[SsdDecode | RcnnDecode | DenseDecode] = RcnnDecode
            if self.batched:
                decode = SsdDecode
            elif dense(self.model):
                decode = DenseDecode
            self._decoders[size] = decode(self.model, size)
        return self._decoders[size]


class DetectorParts(NamedTuple):
    """A detector as an inference runtime serves it: ``graph`` (exported, fixed shapes) and
    ``decode``, which PyTorch runs on the graph's outputs, named ``outputs``; ``box_head``: a
    second graph for the runtime that ``decode`` can run there (``RcnnDecode.with_box_head``),
    a two-stage detector's."""

    graph: nn.Module
    decode: Callable[[Sequence[torch.Tensor]], Detections]
    outputs: tuple[str, ...]
    box_head: RcnnBoxHead | None = None


def detector_parts(module: nn.Module, size: int) -> DetectorParts | None:
    """The parts of a detector a runtime can serve at inputs of ``size``, or None: one that
    answers a list of boxes per image with no part of fixed shapes known here (a model of
    one's own) runs on PyTorch alone.

    SSD and SSDlite: backbone and heads exported, anchors and detections in PyTorch; RetinaNet
    and FCOS the same, their detections the model's own (``tasks.dense``). Faster
    R-CNN and Mask R-CNN: backbone and feature pyramid exported, proposals and suppression in
    PyTorch, the box head a second graph (``tasks.rcnn``). A model that returns padded
    ``(boxes, scores, labels)`` itself: exported whole."""
    if isinstance(module, TorchvisionDetector):
        if module.batched:
            return DetectorParts(SsdGraph(module.model), module.decoder((size, size)),
                                 ("bbox_regression", "cls_logits"))  # fmt: skip
        if dense(module.model):
            return DetectorParts(DenseGraph(module.model), module.decoder((size, size)),
                                 head_outputs(module.model))  # fmt: skip
        if not two_stage(module.model):
            return None
        decode = module.decoder((size, size))
        assert isinstance(decode, RcnnDecode)
        return DetectorParts(RcnnGraph(module.model), decode,
                             tuple(f"features_{level}" for level in decode.levels),
                             RcnnBoxHead(module.model))  # fmt: skip
    with torch.inference_mode():
        answered = module(torch.zeros((1, 3, size, size), device=_device_of(module)))
    if not (isinstance(answered, tuple) and len(answered) == 3):
        return None  # a list of boxes per image, as torchvision's detectors answer
    return DetectorParts(module, _as_detections, ("boxes", "scores", "labels"))


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def _as_detections(outputs: Sequence[torch.Tensor]) -> Detections:
    boxes, scores, labels = outputs
    return boxes, scores, labels.to(torch.int64)


class ServedBatch(nn.Module):
    """In place of a detector's own transform: the images are the server's batch, already
    letterboxed to one size and normalised, so they are stacked back (channels_last, the
    layout the backbone's weights are in), padded to the multiple of ``size_divisible`` the
    detector's feature pyramid needs, and neither normalised nor resized again (torchvision's
    transform would interpolate each image, even to its own size). Boxes come back in the
    input's pixels: its ``postprocess`` maps them from the padded batch to the input, the
    identity here."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original
        self.size_divisible = int(getattr(original, "size_divisible", 1))

    def forward(self, images: list[torch.Tensor], targets: Any = None) -> tuple[Any, Any]:
        # torchvision is imported only for a detector: a start from a kept artefact of a
        # classifier never imports it.
        from torchvision.models.detection.image_list import ImageList

        batch = torch.stack(images)
        height, width = batch.shape[-2:]
        bottom, right = -height % self.size_divisible, -width % self.size_divisible
        if bottom or right:
            batch = pad(batch, (0, right, 0, bottom))
        batch = batch.contiguous(memory_format=torch.channels_last)
        return ImageList(batch, [(int(height), int(width))] * len(images)), targets

    def postprocess(self, result: Any, image_shapes: Any, original_sizes: Any) -> Any:
        return self.original.postprocess(result, image_shapes, original_sizes)  # type: ignore[operator]


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

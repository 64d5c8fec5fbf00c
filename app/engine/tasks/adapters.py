"""torchvision's detection and segmentation models, and its classifiers as encoders, made to
take the server's batch: normalised images of one canvas, each told its own size.

A torchvision detector (Faster R-CNN, Mask R-CNN, Keypoint R-CNN, RetinaNet, FCOS, SSD,
SSDlite) brings its own input transform, ``GeneralizedRCNNTransform``: each image normalised
with the model's statistics, resized (the shorter side to ``min_size`` unless the longer would
pass ``max_size``; SSD's stretched to its ``fixed_size``) bilinearly on the float image without
antialiasing, padded to a multiple of ``size_divisible``. The server does the same
(``input_transform`` reads it from the model), images of one padded canvas share a batch, and
the detector runs as two parts: a graph of fixed arithmetic on the batch (backbone, pyramid,
heads: what a runtime can run) and what PyTorch runs on its outputs told each image's own size
(``DetectorDecoding``: anchors, proposals, pooling, box heads, suppression, each image's
boxes clipped to it), as the model runs them. Boxes, masks and keypoints come back in the
input's pixels; the server maps them to the original image's.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import nn

from app.engine.tasks.dense import DenseDecode, DenseGraph, dense, head_outputs
from app.engine.tasks.hf import HfDetector
from app.engine.tasks.outputs import Detections, detections, segmentation
from app.engine.tasks.rcnn import BoxHeadRun, RcnnBoxHead, RcnnDecode, RcnnGraph, two_stage
from app.engine.tasks.ssd import SsdDecode, SsdGraph
from app.engine.tasks.yolo import YoloDetector
from preprocessing import Fit, TransformConfig
from preprocessing.transforms import Interpolation

ImageSizes = Sequence[tuple[int, int]]


def torchvision_detector(model: Any) -> bool:
    """Whether ``model`` is one of torchvision's detectors (its own transform, a list of
    boxes per image)."""
    return type(model).__name__ in ("SSD", "RetinaNet", "FCOS") or two_stage(model)


def torchvision_segmenter(model: Any) -> bool:
    """Whether ``model`` is one of torchvision's segmenters (DeepLabV3, FCN, LRASPP)."""
    return type(model).__name__ in ("DeepLabV3", "FCN", "LRASPP")


def input_transform(model: Any, size: int | None = None) -> TransformConfig:
    """A torchvision detector's ``GeneralizedRCNNTransform`` as the server's transform; ``size``
    (``IMAGE_SIZE``) is its ``min_size`` (or SSD's fixed size), set on the model too, so that
    the model's own pipeline and the server's agree (torchvision's ``min_size=`` argument)."""
    transform = model.transform
    base = TransformConfig(
        mean=tuple(transform.image_mean), std=tuple(transform.image_std),
        interpolation=Interpolation.BILINEAR, antialias=False, float_resize=True,
        size_divisible=int(transform.size_divisible),
    )  # fmt: skip
    if transform.fixed_size is not None:
        width, height = transform.fixed_size
        if size is not None:
            width = height = size
            transform.fixed_size = (size, size)
        if width != height:
            raise ValueError(f"a fixed input of {width}x{height} (only squares are served)")
        return replace(base, crop_size=height, resize_size=height, fit=Fit.STRETCH)
    if size is not None:
        transform.min_size = (size,)
    min_size = int(transform.min_size[-1])
    return replace(
        base,
        crop_size=min_size,
        resize_size=min_size,
        fit=Fit.MIN_MAX,
        max_size=int(transform.max_size),
    )


class TorchvisionDetector(nn.Module):
    """A torchvision detector taking the server's batch ``[N, 3, H, W]`` and each image's
    own size in it: its graph, then its decoding."""

    takes_sizes = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.graph = detector_graph(model)
        self.decoding = DetectorDecoding(model)

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Detections:
        canvas = (int(batch.shape[-2]), int(batch.shape[-1]))
        return self.decoding(self.graph(batch), canvas, sizes)


def detector_graph(model: Any) -> nn.Module:
    """What of a torchvision detector is fixed arithmetic on the batch: SSD's backbone and
    heads, RetinaNet's and FCOS's backbone, pyramid and heads, a two-stage detector's backbone
    and pyramid."""
    if type(model).__name__ == "SSD":
        return SsdGraph(model)
    if dense(model):
        return DenseGraph(model)
    return RcnnGraph(model)


def graph_outputs(model: Any) -> tuple[str, ...]:
    """The names of the graph's outputs, in order."""
    if type(model).__name__ == "SSD":
        return ("bbox_regression", "cls_logits")
    if dense(model):
        return head_outputs(model)
    levels = RcnnDecode.levels_of(model)
    return tuple(f"features_{level}" for level in levels)


Decoder = SsdDecode | RcnnDecode | DenseDecode


class DetectorDecoding:
    """What PyTorch runs of a torchvision detector on its graph's outputs, for a batch of any
    canvas: one decoder per canvas (anchors and feature levels follow its size, not the
    pixels), made when first needed; each image clipped to its own size. ``box_head``: a
    two-stage detector's box head run elsewhere (a runtime's second graph)."""

    def __init__(self, model: Any, box_head: BoxHeadRun | None = None) -> None:
        self.model = model
        self.box_head = box_head
        self._decoders: dict[tuple[int, int], Decoder] = {}
        self._lock = threading.Lock()

    def __call__(
        self, outputs: Sequence[torch.Tensor], canvas: tuple[int, int], sizes: ImageSizes | None
    ) -> Detections:
        if sizes is None:  # each image fills the canvas
            sizes = [canvas] * int(outputs[0].shape[0])
        return self.decoder(canvas)(outputs, list(sizes))

    def decoder(self, canvas: tuple[int, int]) -> Decoder:
        decoder = self._decoders.get(canvas)
        if decoder is None:
            with self._lock:
                decoder = self._decoders.get(canvas)
                if decoder is None:
                    decoder = self._decoders[canvas] = self._made(canvas)
        return decoder

    def _made(self, canvas: tuple[int, int]) -> Decoder:
        if type(self.model).__name__ == "SSD":
            return SsdDecode(self.model, canvas)
        if dense(self.model):
            return DenseDecode(self.model, canvas)
        decode = RcnnDecode(self.model, canvas)
        return decode.with_box_head(self.box_head) if self.box_head is not None else decode

    def __deepcopy__(self, memo: dict[int, Any]) -> DetectorDecoding:
        # The copy decodes with the copied model (its decoders made again when needed).
        return DetectorDecoding(copy.deepcopy(self.model, memo), self.box_head)

    def with_box_head(self, run: BoxHeadRun) -> DetectorDecoding:
        """This decoding with a two-stage detector's box head run by ``run``."""
        return DetectorDecoding(self.model, run)

    @property
    def torch_heavy(self) -> bool:
        """Whether torch computes most of the model's arithmetic (a two-stage detector's box
        head on every proposal, where no runtime runs it): it then wants every thread."""
        return two_stage(self.model) and self.box_head is None

    @property
    def two_stage(self) -> bool:
        return two_stage(self.model)


class DetectorParts(NamedTuple):
    """A detector as an inference runtime serves it: ``graph`` (exported) and ``decode``,
    which PyTorch runs on the graph's outputs, named ``outputs``, for a canvas and each
    image's size; ``box_head``: a second graph that ``decode`` can run on the runtime
    (``DetectorDecoding.with_box_head``), a two-stage detector's."""

    graph: nn.Module
    decode: Callable[[Sequence[torch.Tensor], tuple[int, int], ImageSizes | None], Detections]
    outputs: tuple[str, ...]
    box_head: RcnnBoxHead | None = None


def detector_parts(module: nn.Module, canvas: tuple[int, int]) -> DetectorParts | None:
    """The parts of a detector a runtime can serve (exported at ``canvas``), or None: one that
    answers a list of boxes per image with no part of fixed shapes known here (a model of
    one's own) runs on PyTorch alone.

    torchvision's: its graph and decoding (``TorchvisionDetector``), a two-stage detector's
    box head a second graph (``tasks.rcnn``); a YOLO model's network to its raw head
    (``tasks.yolo``). A model that returns padded ``(boxes, scores, labels)`` itself: exported
    whole."""
    if isinstance(module, TorchvisionDetector):
        box_head = RcnnBoxHead(module.model) if two_stage(module.model) else None
        return DetectorParts(module.graph, module.decoding, graph_outputs(module.model), box_head)
    if isinstance(module, YoloDetector):
        outputs = ("head", "prototypes") if module.decoding.masks else ("head",)
        return DetectorParts(module.graph, module.decoding, outputs)
    if isinstance(module, HfDetector):
        return DetectorParts(module.graph, module.decoding, ("logits", "pred_boxes"))
    with torch.inference_mode():
        answered = module(torch.zeros((1, 3, *canvas), device=_device_of(module)))
    if not (isinstance(answered, tuple) and len(answered) == 3):
        return None  # a list of boxes per image, as torchvision's detectors answer
    return DetectorParts(module, _as_detections, ("boxes", "scores", "labels"))


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def _as_detections(
    outputs: Sequence[torch.Tensor], canvas: tuple[int, int], sizes: ImageSizes | None
) -> Detections:
    boxes, scores, labels = outputs
    return detections((boxes, scores, labels.to(torch.int64)))


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

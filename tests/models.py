"""Small deterministic models for tests: no downloads, outputs that really depend on the input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

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


class ConvColorClassifier(nn.Module):
    """The colour classifier behind a small convolutional stem, so that INT8 has real
    convolutions to run (and runs faster than fp32, as on real models).

    The stem's fixed filters are local averages of each colour channel with both signs, so
    that after the ReLU the features still carry the colours, and the next layers sum them in
    fixed positive combinations: the answers stay input-dependent and mostly confident.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False)
        self.mix = nn.Sequential(
            nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1, bias=False), nn.ReLU(),
        )  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(64 * 4, NUM_COLOR_CLASSES)
        generator = torch.Generator().manual_seed(4321)
        with torch.no_grad():
            self.stem.weight.zero_()
            for out in range(32):
                sign = 1.0 if (out // 3) % 2 == 0 else -1.0
                self.stem.weight[out, out % 3] = sign * (1 + out // 6) / 9
            for layer in (self.mix[0], self.mix[2]):
                assert isinstance(layer, nn.Conv2d)
                fan_in = layer.in_channels * 9
                layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 / fan_in)
            self.head.weight.copy_(torch.randn(NUM_COLOR_CLASSES, 64 * 4, generator=generator))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.mix(torch.relu(self.stem(x)))
        logits: torch.Tensor = self.head(torch.flatten(self.pool(features), 1))
        return logits


def conv_color_classifier() -> nn.Module:
    return ConvColorClassifier()


class OverlapProbe(ColorClassifier):
    """Records how many forward passes run at once, across every instance: two models sharing
    a device must never overlap. Each pass takes ``OverlapProbe.seconds``. Serve it with
    ``COMPILE=none`` (tracing keeps tensor operations only)."""

    seconds = 0.0
    running = 0
    most = 0
    passes = 0
    _lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with OverlapProbe._lock:
            OverlapProbe.running += 1
            OverlapProbe.passes += 1
            OverlapProbe.most = max(OverlapProbe.most, OverlapProbe.running)
        try:
            if OverlapProbe.seconds > 0:
                time.sleep(OverlapProbe.seconds)
            return super().forward(x)
        finally:
            with OverlapProbe._lock:
                OverlapProbe.running -= 1


def overlap_probe() -> nn.Module:
    return OverlapProbe()


class Ballast(ColorClassifier):
    """The colour classifier carrying ``BATCHSERVE_TEST_BALLAST_MIB`` of weights that do
    nothing, and taking ``BATCHSERVE_TEST_BUILD_SECONDS`` to build: a large model that loads
    slowly, whose memory shows whether a version was freed."""

    def __init__(self, ballast_mib: float) -> None:
        super().__init__()
        elements = int(ballast_mib * 1024 * 1024 / 4)
        self.register_buffer("ballast", torch.ones(elements))  # touched: resident


def ballast_from_env() -> nn.Module:
    import os

    time.sleep(float(os.environ.get("BATCHSERVE_TEST_BUILD_SECONDS", "0")))
    return Ballast(float(os.environ.get("BATCHSERVE_TEST_BALLAST_MIB", "0")))


# Beyond classification: models whose right answers are known from the pixels. A pixel counts
# as bright when its normalised channels average above 1 (white is about 2.2, black -1.8 and
# the letterbox's mean-colour fill 0), so a white rectangle on black is found exactly where it
# was drawn, whatever the image's size, aspect ratio or place in a batch.
BRIGHT = 1.0


def _bright(x: torch.Tensor) -> torch.Tensor:
    """``bool[N, H, W]``: which pixels are bright."""
    return x.mean(dim=1) > BRIGHT


def _extent(found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last index where ``found [N, L]`` is true (0, 0 where it never is)."""
    length = found.shape[1]
    index = torch.arange(length, device=found.device).expand_as(found)
    first = torch.where(found, index, length).min(dim=1).values
    last = torch.where(found, index + 1, 0).max(dim=1).values
    return torch.minimum(first, last), last


class BrightBoxDetector(nn.Module):
    """Finds the bright rectangle of each image: its bounding box at score 0.9 (label 1), the
    same box shifted by one pixel at 0.8 (a duplicate that non-maximum suppression must
    drop), and the whole input at 0.4 (label 2). No bright pixel: scores of 0 (padding)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bright = _bright(x)
        y1, y2 = _extent(bright.any(dim=2))
        x1, x2 = _extent(bright.any(dim=1))
        box = torch.stack([x1, y1, x2, y2], dim=1).float()
        whole = torch.tensor([0.0, 0.0, x.shape[3], x.shape[2]]).expand_as(box)
        boxes = torch.stack([box, box + 1, whole], dim=1)
        present = bright.flatten(1).any(dim=1).float().unsqueeze(1)
        scores = present * torch.tensor([[0.9, 0.8, 0.4]])
        labels = torch.tensor([[1, 1, 2]]).expand(x.shape[0], 3)
        return boxes, scores, labels


def bright_box_detector() -> nn.Module:
    return BrightBoxDetector()


class CornerBoxDetector(nn.Module):
    """The bright box, and a box in the input's bottom-right corner scoring 0.99: in a
    letterboxed wide image, a box that lies wholly in the padding."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        boxes, scores, labels = BrightBoxDetector()(x)
        height, width = x.shape[2], x.shape[3]
        corner = torch.tensor([[[width - 8.0, height - 8.0, width, height]]]).expand(
            x.shape[0], 1, 4)  # fmt: skip
        return (torch.cat([boxes, corner], dim=1),
                torch.cat([scores, torch.full((x.shape[0], 1), 0.99)], dim=1),
                torch.cat([labels, torch.full((x.shape[0], 1), 2)], dim=1))  # fmt: skip


def corner_box_detector() -> nn.Module:
    return CornerBoxDetector()


class BrightListDetector(nn.Module):
    """The same boxes as torchvision's detectors answer them: a list of one dict per image,
    with as many boxes as each image has (none without a bright pixel)."""

    def __init__(self) -> None:
        super().__init__()
        self.boxes = BrightBoxDetector()

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        boxes, scores, labels = self.boxes(x)
        return [{"boxes": b[s > 0][:1], "scores": s[s > 0][:1], "labels": lab[s > 0][:1]}
                for b, s, lab in zip(boxes, scores, labels, strict=True)]  # fmt: skip


def bright_list_detector() -> nn.Module:
    return BrightListDetector()


class BrightSegmenter(nn.Module):
    """Class 1 where a pixel is bright, class 0 elsewhere: logits ``[N, 2, H, W]``, returned
    as torchvision's segmenters do (``{"out": logits}``)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        margin = x.mean(dim=1) - BRIGHT
        return {"out": torch.stack([-margin, margin], dim=1)}


def bright_segmenter() -> nn.Module:
    return BrightSegmenter()


class ManyClassSegmenter(nn.Module):
    """300 classes: class 299 where a pixel is bright, class 0 elsewhere (an index past what
    eight bits hold)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        margin = (x.mean(dim=1) - BRIGHT).unsqueeze(1)
        classes = torch.zeros(x.shape[0], 300, *x.shape[2:], device=x.device)
        return torch.cat([-margin, classes[:, 1:-1] - 10, margin], dim=1)


def many_class_segmenter() -> nn.Module:
    return ManyClassSegmenter()


class MeanColorEncoder(nn.Module):
    """An encoder whose vector is known from the pixels: the normalised mean colour of each
    cell of a 2x2 grid, ``[N, 12]`` (cell by cell, red, green and blue)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features: torch.Tensor = self.pool(x).permute(0, 2, 3, 1).flatten(1)
        return features


def mean_color_encoder() -> nn.Module:
    return MeanColorEncoder()


class ConvSegmenter(nn.Module):
    """Each pixel's strongest normalised colour channel as its class (0 red, 1 green, 2 blue),
    through real convolutions, for INT8: the conv classifier's stem (each channel's local
    average, with both signs), a 3x3 convolution that smooths each of its channels, and a 1x1
    one that sums each colour's channels back with their signs; upsampled to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvColorClassifier().stem
        self.smooth = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.classes = nn.Conv2d(32, 3, 1, bias=False)
        with torch.no_grad():
            self.smooth.weight.zero_()
            self.classes.weight.zero_()
            for channel in range(32):
                self.smooth.weight[channel, channel] = 1 / 9
                sign = 1.0 if (channel // 3) % 2 == 0 else -1.0
                self.classes.weight[channel % 3, channel] = sign / (1 + channel // 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.classes(torch.relu(self.smooth(torch.relu(self.stem(x)))))
        return nn.functional.interpolate(logits, size=x.shape[-2:], mode="bilinear")


def conv_segmenter() -> nn.Module:
    return ConvSegmenter()


class ConvEncoder(nn.Module):
    """The conv classifier without its head: its pooled features, ``[N, 256]``."""

    def __init__(self) -> None:
        super().__init__()
        body = ConvColorClassifier()
        self.stem, self.mix, self.pool = body.stem, body.mix, body.pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.mix(torch.relu(self.stem(x)))), 1)


def conv_encoder() -> nn.Module:
    return ConvEncoder()


class FloatProbeEncoder(ConvEncoder):
    """The conv encoder that also runs a float32 probe through its stem on every call, as
    torchvision's detectors size their anchors: converted to bf16, it does not run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe: torch.Tensor = self.stem(torch.zeros((1, 3, 8, 8), device=x.device))
        return super().forward(x) + 0 * probe.mean()


def float_probe_encoder() -> nn.Module:
    return FloatProbeEncoder()


GRID = 7  # a detector's cells along each side


class ConvGridDetector(nn.Module):
    """A detector through real convolutions, for INT8: the conv segmenter's colour logits
    pooled to a 7x7 grid of cells, each of which answers one box (label: its strongest colour,
    1 to 3; score: how far that colour leads, so that some cells are confident and others not;
    box: the cell, grown by how strong its colour is), ``(boxes, scores, labels)``."""

    def __init__(self) -> None:
        super().__init__()
        self.colours = ConvSegmenter()
        self.cells = nn.AdaptiveAvgPool2d(GRID)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        colours = self.colours
        logits = colours.classes(torch.relu(colours.smooth(torch.relu(colours.stem(x)))))
        cells = self.cells(logits).flatten(2).transpose(1, 2)  # [N, cells, 3]
        top = cells.topk(2, dim=2).values
        scores = torch.sigmoid(top[..., 0] - top[..., 1] - 2)
        labels = cells.argmax(dim=2) + 1
        height, width = x.shape[-2] / GRID, x.shape[-1] / GRID
        index = torch.arange(GRID * GRID, device=x.device)
        centre_x = ((index % GRID).float() + 0.5) * width
        centre_y = ((index // GRID).float() + 0.5) * height
        grow = 0.5 + 0.5 * torch.sigmoid(top[..., 0] / 4 - 1)  # of a cell's side, each way
        boxes = torch.stack([centre_x - grow * width, centre_y - grow * height,
                             centre_x + grow * width, centre_y + grow * height], dim=2)  # fmt: skip
        return boxes, scores, labels


def conv_grid_detector() -> nn.Module:
    return ConvGridDetector()


class BlindDetector(nn.Module):
    """Finds nothing in any image: one box per image, of score 0 (padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = x[:, 0, 0, :1] * self.scale  # [N, 1] of zeros that follow the input
        boxes = torch.stack([scores] * 4, dim=2)
        return boxes, scores, torch.ones_like(scores, dtype=torch.int64)


def blind_detector() -> nn.Module:
    return BlindDetector()


def resnet18_faster_rcnn() -> nn.Module:
    """Faster R-CNN on a ResNet-18 feature pyramid: proposals pooled from four levels by their
    size; random weights, every proposal's best classes answered."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None)
    return _every_box(lambda: FasterRCNN(backbone, num_classes=5))


def _every_box(build: Callable[[], Any]) -> nn.Module:
    torch.manual_seed(0)
    model: Any = build()
    model.roi_heads.score_thresh = 0.0
    built: nn.Module = model
    return built


def resnet18_retinanet() -> nn.Module:
    """RetinaNet on a ResNet-18 pyramid of five levels (nine anchors a place), random weights,
    every candidate above a score of 0 answered."""
    from torchvision.models.detection import RetinaNet

    return _dense_detector(RetinaNet)


def resnet18_fcos() -> nn.Module:
    """FCOS on a ResNet-18 pyramid of five levels (one point a place, with its centre-ness),
    random weights, every candidate above a score of 0 answered."""
    from torchvision.models.detection import FCOS

    return _dense_detector(FCOS)


def _dense_detector(kind: Callable[..., Any]) -> nn.Module:
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    torch.manual_seed(0)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None,
                                   returned_layers=[2, 3, 4],
                                   extra_blocks=LastLevelP6P7(256, 256))  # fmt: skip
    model: nn.Module = kind(backbone, num_classes=5, score_thresh=0.0)
    return model

"""What the fidelity tests serve and hold the server to: every torchvision detection and
segmentation family, random weights whose answers spread (``harness.spread``, saved as a
checkpoint and served from it), real photos of several aspect ratios, and each family's own
pipeline as the reference (``harness.reference``).

Families with a ResNet-50 (RetinaNet, FCOS, Mask R-CNN, Keypoint R-CNN, FCN) are built here
as torchvision builds them but on a ResNet-18 pyramid and at a smaller ``min_size`` (their
builders' own arguments): the same heads, transform and decoding, at a cost the test suite
can pay. SSDlite, Faster R-CNN MobileNetV3 320, DeepLabV3 and LRASPP are torchvision's named
architectures at their own sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness import reference
from harness.photos import photos, shapes
from harness.spread import spread

__all__ = ["FAMILIES", "FAMILY", "checkpoint", "photos", "reference_answers", "shapes"]


@dataclass(frozen=True)
class Family:
    """One torchvision architecture family as the tests serve it."""

    name: str
    model: str  # what MODEL names: a torchvision architecture, or a factory here
    task: str
    settings: dict[str, Any] = field(default_factory=dict)
    spread: dict[str, Any] = field(default_factory=dict)
    runtimes: tuple[str, ...] = ("onnxruntime", "openvino")

    def build(self) -> nn.Module:
        """The model as its library builds it (random weights, to be replaced)."""
        if ":" in self.model:
            module, _, attr = self.model.partition(":")
            factory: Callable[[], nn.Module] = getattr(__import__(module, fromlist=[attr]), attr)
            return factory()
        from torchvision.models import get_model

        built: nn.Module = get_model(self.model, weights=None, weights_backbone=None)
        return built

    def answers(self, module: nn.Module, shots: tuple[bytes, ...] | None = None) -> list[Any]:
        """The family's own pipeline's answers on the photos (``shots``: these)."""
        shots = photos() if shots is None else shots
        if self.task == "detect":
            return list(reference.detected(module, shots))
        return list(reference.segmented(module, shots, self.reference_transform()))

    def reference_transform(self) -> Any:
        """A segmenter's preset: its weights' (520 px) or the size it is served at."""
        from preprocessing import TransformConfig

        size = int(self.settings.get("image_size", 520))
        return TransformConfig(crop_size=size, resize_size=size)


FAMILIES = (
    Family("ssdlite", "ssdlite320_mobilenet_v3_large", "detect", spread={"class_spread": 1.3}),
    Family("faster_rcnn", "fasterrcnn_mobilenet_v3_large_320_fpn", "detect"),
    Family("retinanet", "tests.fidelity:retinanet", "detect", spread={"sigmoid_confident": 1e-5}),
    Family("fcos", "tests.fidelity:fcos", "detect", spread={"sigmoid_confident": 3e-5}),
    Family("mask_rcnn", "tests.fidelity:mask_rcnn", "detect", spread={"class_spread": 1.5}),
    Family("keypoint_rcnn", "tests.fidelity:keypoint_rcnn", "detect"),
    Family("deeplabv3", "deeplabv3_mobilenet_v3_large", "segment"),
    Family(
        "fcn", "tests.fidelity:fcn", "segment", settings={"fit": "shorter-side", "image_size": 320}
    ),
    Family("lraspp", "lraspp_mobilenet_v3_large", "segment"),
)
FAMILY = {family.name: family for family in FAMILIES}

# The smaller detectors' transform: torchvision's builders' own arguments.
SMALL = {"min_size": 320, "max_size": 512}
# Mask R-CNN's and Keypoint R-CNN's heads run on every proposal and every box answered:
# fewer of them, and narrower heads (torchvision's own, built as its builders take them)
# than Keypoint R-CNN's eight 512-wide convolutions, seconds an image on two cores.
FEW = {"box_detections_per_img": 20, "rpn_pre_nms_top_n_test": 300, "rpn_post_nms_top_n_test": 100}


def _built(module: Any) -> nn.Module:
    """``module``, typed (torchvision's builders are not)."""
    assert isinstance(module, nn.Module)
    return module


def _pyramid(**options: Any) -> nn.Module:
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    backbone: nn.Module = resnet_fpn_backbone(backbone_name="resnet18", weights=None, **options)
    return backbone


def _dense_pyramid() -> nn.Module:
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    return _pyramid(returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))


def retinanet() -> nn.Module:
    from torchvision.models.detection import RetinaNet

    return _built(RetinaNet(_dense_pyramid(), num_classes=91, **SMALL))


def fcos() -> nn.Module:
    from torchvision.models.detection import FCOS

    return _built(FCOS(_dense_pyramid(), num_classes=91, **SMALL))


def mask_rcnn() -> nn.Module:
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

    model = MaskRCNN(
        _pyramid(),
        box_predictor=FastRCNNPredictor(1024, 91),
        mask_head=MaskRCNNHeads(256, [64, 64], 1),
        mask_predictor=MaskRCNNPredictor(64, 64, 91),
        **SMALL,
        **FEW,
    )
    return _built(model)


def keypoint_rcnn() -> nn.Module:
    from torchvision.models.detection import KeypointRCNN
    from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads

    model = KeypointRCNN(
        _pyramid(),
        num_classes=2,
        keypoint_head=KeypointRCNNHeads(256, [64, 64]),
        keypoint_predictor=_keypoint_predictor(),
        **SMALL,
        **FEW,
    )
    return _built(model)


def _keypoint_predictor() -> nn.Module:
    from torchvision.models.detection.keypoint_rcnn import KeypointRCNNPredictor

    return _built(KeypointRCNNPredictor(64, 17))


def fcn() -> nn.Module:
    """torchvision's FCN (its head on the last stage of a ResNet-18, dilated as torchvision
    dilates its ResNet-50's would not be: a plain one)."""
    from torchvision.models import resnet18
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.fcn import FCN, FCNHead

    backbone = IntermediateLayerGetter(resnet18(weights=None), {"layer4": "out"})
    return _built(FCN(backbone, FCNHead(512, 21)))


@functools.cache
def checkpoint(name: str, folder: Path) -> Path:
    """The family's spread weights, saved once in ``folder``: drawn on the photos run through
    the family's own pipeline."""
    family = FAMILY[name]
    module = family.build().eval()
    shots = photos()[::4]  # three photos, each of another shape
    spread(module, lambda model: family.answers(model, shots), **family.spread)
    path = folder / f"{name}.pt"
    torch.save(module.state_dict(), path)
    return path


def reference_answers(name: str, weights: Path) -> list[Any]:
    """The family's own pipeline's answers with these weights, photo by photo."""
    family = FAMILY[name]
    module = family.build()
    module.load_state_dict(torch.load(weights, weights_only=True))
    return family.answers(module.eval())

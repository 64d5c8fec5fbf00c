"""Random weights whose answers are worth comparing: what fidelity is judged with when no
trained weights can be had offline.

torchvision's own initialisation gives a detector nothing to compare: SSDlite scores every
anchor 1/91, Faster R-CNN answers no box. ``spread`` draws every convolution and dense layer
again from a fixed seed at He scale (normalisation layers made the identity, biases zero),
then, on a real photo run through the model's own pipeline (``calibrate``), scales each head
so that its outputs spread as a trained model's do: class logits of a few units (some tens
of confident boxes a photo, masks of several classes; a sigmoid head's centred low, so that
few of its hundreds of thousands of anchors are confident), box offsets of a tenth of a
unit (boxes stay near their anchors). A layer that holds fixed values rather than weights
(YOLO's distribution-to-distance convolution) is left alone. The same seed and photo give
the same weights everywhere: save them with ``torch.save(model.state_dict(), path)`` and
serve that checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# What each head's outputs are scaled to (their standard deviation), and the share of a
# sigmoid head's outputs that are confident (above 0).
CLASS_SPREAD = 3.0
SIGMOID_SPREAD = 2.0
SIGMOID_CONFIDENT = 2e-5
BOX_SPREAD = 0.1
# A YOLO box side's logits over its bins: some sides sharp, some spread (boxes of many sizes).
DISTRIBUTION_SPREAD = 2.0
# A YOLO head without bins (YOLO26's) answers each side's distance from the anchor point in
# strides: positive, a few strides, some near and some far.
DISTANCE_SPREAD = 0.75
DISTANCE_CENTRE = 3.0
DISTANCE_FLOOR = 0.25  # the shortest, on the calibration photos: no box turned inside out


def spread(
    model: nn.Module,
    calibrate: Callable[[nn.Module], Any],
    seed: int = 0,
    *,
    class_spread: float = CLASS_SPREAD,
    sigmoid_confident: float = SIGMOID_CONFIDENT,
) -> nn.Module:
    """``model``'s weights drawn again from ``seed`` and its heads scaled on what
    ``calibrate(model)`` runs (the model's own pipeline on photos), in place: a softmax
    head's logits to ``class_spread``, a sigmoid head's to ``sigmoid_confident`` of its
    outputs above 0."""
    generator = torch.Generator().manual_seed(seed)
    fixed = _fixed_layers(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d | nn.Linear | nn.ConvTranspose2d):
                if module not in fixed:
                    _drawn(module, generator)
            elif _normalisation(module):
                for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0),
                                    ("running_var", 1.0)):  # fmt: skip
                    tensor = getattr(module, name, None)
                    if isinstance(tensor, torch.Tensor):
                        tensor.fill_(value)
        # Normalisation layers given the statistics of the photos' own activations, as trained
        # ones hold theirs: each layer's input then has a unit scale whatever the layers
        # before it did. First as the first photo reaches each layer (so that nothing before
        # it has overflowed), then over every photo, twice (each layer's input moves as those
        # before it settle).
        _channel_statistics(model, calibrate, at_once=True)
        for _ in range(2):
            for layer, (mean, variance) in _channel_statistics(model, calibrate).items():
                layer.running_mean.copy_(mean)
                layer.running_var.copy_(variance)
        heads = _heads(model)
        # Twice: a head's input moves when the heads before it (the proposals') are scaled.
        for _ in range(2):
            measured = _measured(model, calibrate, heads, sigmoid_confident)
            for layer, (mean, std, top, bottom) in measured.items():
                role = heads[layer]
                target = {"class": class_spread, "sigmoid": SIGMOID_SPREAD, "centre": 1.0,
                          "box": BOX_SPREAD, "distribution": DISTRIBUTION_SPREAD,
                          "distance": DISTANCE_SPREAD}[role]  # fmt: skip
                # At most a thousand times the target spread left to the bias to cancel: an
                # output whose mean dwarfs its spread would otherwise be a difference of large
                # numbers, decided by rounding (and by the kernels a batch size picks).
                offset = float((mean - (layer.bias if layer.bias is not None else 0)).abs().max())
                scale = min(target / max(std, 1e-12), 1000 * target / max(offset, 1e-12))
                layer.weight.mul_(scale)
                # Each output centred: no class wins everywhere for features that all share a
                # positive mean (after a ReLU); a sigmoid's moved so that few are confident.
                centre = {"sigmoid": -top * scale,
                          "distance": max(DISTANCE_CENTRE, DISTANCE_FLOOR - bottom * scale)
                          }.get(role, 0.0)  # fmt: skip
                bias = centre - (mean - (layer.bias if layer.bias is not None else 0)) * scale
                if layer.bias is None:
                    layer.bias = nn.Parameter(bias, requires_grad=False)
                else:
                    layer.bias.copy_(bias)
    return model


def _fixed_layers(model: nn.Module) -> set[nn.Module]:
    """Layers that hold fixed values, not weights: a YOLO head's distribution-to-distance
    convolution (``DFL``: the bins' indices, frozen)."""
    layers = [getattr(each, "conv", None) for each in model.modules()
              if type(each).__name__ == "DFL"]  # fmt: skip
    return {each for each in layers if isinstance(each, nn.Conv2d)}


def _drawn(module: nn.Conv2d | nn.Linear | nn.ConvTranspose2d, generator: torch.Generator) -> None:
    weight = module.weight
    fan_in = weight[0].numel()
    if isinstance(module, nn.ConvTranspose2d):
        fan_in = weight.shape[0] * weight[0, 0].numel()
    weight.copy_(torch.randn(weight.shape, generator=generator) * math.sqrt(2.0 / fan_in))
    if module.bias is not None:
        module.bias.zero_()


def _measured(
    model: nn.Module,
    calibrate: Callable[[nn.Module], Any],
    heads: dict[Any, str],
    top_share: float,
) -> dict[Any, tuple[torch.Tensor, float, float, float]]:
    """Each head's outputs on the calibration run: their mean per output channel, their
    standard deviation about it, the value about it that ``top_share`` of them exceed, and
    the lowest about it."""
    outputs: dict[Any, list[torch.Tensor]] = {}

    def hook(layer: Any, _: Any, output: torch.Tensor) -> None:
        values = output.detach().float()
        if values.ndim >= 2 and values.numel():  # [N, C] or [N, C, H, W]: C first
            outputs.setdefault(layer, []).append(values.transpose(0, 1).flatten(1))

    handles = [layer.register_forward_hook(hook) for layer in heads]
    try:
        with torch.inference_mode():
            calibrate(model.eval())
    finally:
        for handle in handles:
            handle.remove()
    seen: dict[Any, tuple[torch.Tensor, float, float, float]] = {}
    for layer, each in outputs.items():
        values = torch.cat(each, dim=1)
        if values.shape[1] > 1:
            mean = values.mean(dim=1)
            centred = (values - mean[:, None]).flatten()
            rank = max(1, int(len(centred) * (1 - top_share)))
            top = float(centred.kthvalue(min(rank, len(centred))).values)
            seen[layer] = (mean, float(centred.std()), top, float(centred.min()))
    return seen


def _channel_statistics(
    model: nn.Module, calibrate: Callable[[nn.Module], Any], *, at_once: bool = False
) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """Each batch normalisation layer's input: its mean and variance per channel, over every
    place of every photo of the calibration run; ``at_once``: set as the run first reaches
    each layer, from that photo alone."""
    inputs: dict[Any, list[torch.Tensor]] = {}

    def hook(layer: Any, args: tuple[torch.Tensor, ...]) -> None:
        values = args[0].detach().float().transpose(0, 1).flatten(1)
        if at_once and layer not in inputs and values.shape[1] >= 16:
            layer.running_mean.copy_(values.mean(dim=1))
            layer.running_var.copy_(values.var(dim=1, unbiased=False).clamp(min=1e-4))
        inputs.setdefault(layer, []).append(values)

    layers = [each for each in model.modules() if hasattr(each, "running_var")]
    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    try:
        with torch.inference_mode():
            calibrate(model.eval())
    finally:
        for handle in handles:
            handle.remove()
    statistics = {}
    for layer, each in inputs.items():
        values = torch.cat(each, dim=1)
        if values.shape[1] >= 16:  # a few values (a 1x1 map of one photo) say nothing
            variance = values.var(dim=1, unbiased=False)
            statistics[layer] = (values.mean(dim=1), variance.clamp(min=1e-4))
    return statistics


def _normalisation(module: nn.Module) -> bool:
    return isinstance(module, nn.BatchNorm2d | nn.GroupNorm | nn.LayerNorm) or (
        type(module).__name__ == "FrozenBatchNorm2d"
    )


# The last layers of torchvision's heads, by name: class logits of a softmax, of a sigmoid
# (per anchor and class: RetinaNet, FCOS, a region proposal network's objectness), and box
# offsets.
_SOFTMAX = ("cls_score", "mask_fcn_logits", "kps_score_lowres")
_SIGMOID = ("cls_logits",)
_BOXES = ("bbox_pred", "bbox_reg")


def _heads(model: nn.Module) -> dict[Any, str]:
    """Each head's last layer and its role (``class``, ``sigmoid``, ``box``)."""
    inner: Any = model
    found: dict[Any, str] = {}
    for name, module in inner.named_modules():
        if not isinstance(module, nn.Conv2d | nn.Linear | nn.ConvTranspose2d):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _SOFTMAX or _segmentation_classifier(name, inner):
            found[module] = "class"
        elif leaf in _SIGMOID:
            found[module] = "sigmoid"
        elif leaf == "bbox_ctrness":  # FCOS's centre-ness, a sigmoid about a half
            found[module] = "centre"
        elif leaf in _BOXES:
            found[module] = "box"
    if type(inner).__module__.startswith("ultralytics."):
        found.update(_yolo_heads(inner))
    if type(inner).__name__ == "SSD":  # one head per level: each one's last convolution
        for heads, role in ((inner.head.classification_head, "class"),
                            (inner.head.regression_head, "box")):  # fmt: skip
            for level in heads.module_list:
                last = [each for each in level.modules() if isinstance(each, nn.Conv2d)][-1]
                found[last] = role
    return found


def _yolo_heads(model: Any) -> dict[Any, str]:
    """An Ultralytics YOLO head's last layers: a classifier's linear layer; a detector's last
    convolution per level of its class scores (``cv3``, a sigmoid), its box distributions
    (``cv2``, a softmax over each side's bins) and its keypoints (``cv4``, offsets from the
    anchor point); an end-to-end head's one-to-one copies (``one2one_cv2``…) alike. A head
    of one bin a side (``reg_max`` 1) answers distances, not distributions."""
    head = model.model[-1]
    found: dict[Any, str] = {}
    if isinstance(getattr(head, "linear", None), nn.Linear):  # a classifier's
        found[head.linear] = "class"
    sides = "distance" if getattr(head, "reg_max", 16) == 1 else "distribution"
    for branch, role in (("cv3", "sigmoid"), ("cv2", sides), ("cv4", "box")):
        for level in (*(getattr(head, branch, None) or ()),
                      *(getattr(head, f"one2one_{branch}", None) or ())):  # fmt: skip
            last = [each for each in level.modules() if isinstance(each, nn.Conv2d)][-1]
            found[last] = role
    return found


def _segmentation_classifier(name: str, model: Any) -> bool:
    """The last convolution of a segmenter's classifier (DeepLabV3's, FCN's, LRASPP's)."""
    if type(model).__name__ not in ("DeepLabV3", "FCN", "LRASPP"):
        return False
    if name in ("classifier.low_classifier", "classifier.high_classifier"):
        return True
    convolutions = [n for n, m in model.classifier.named_modules() if isinstance(m, nn.Conv2d)]
    return name == f"classifier.{convolutions[-1]}"

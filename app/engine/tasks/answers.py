"""A batch's outputs turned into each image's answer, in the original image's pixels.

Undoing the input's geometry is arithmetic on the batch: an image of ``W`` x ``H`` pixels
whose content is ``w`` x ``h`` at ``(left, top)`` of the canvas (its ``Placement``) has a
box's x mapped by ``(x - left) * W / w`` and its y by ``(y - top) * H / h``, per row, as
torchvision's ``resize_boxes`` maps them; then every box is clipped to the image and a box
left without area (one that lay in the padding) is no box. The score threshold, the
server's non-maximum suppression where the model runs none of its own
(``torchvision.ops.batched_nms``, per class) and the cap come after. Mask R-CNN's masks are
pasted into the image by torchvision's own ``paste_masks_in_image`` at the mapped boxes,
binarised at 0.5 as its documentation does, and encoded as COCO run-length
(``pycocotools``); keypoints are mapped as boxes are. A segmenter's mask is the per-pixel
arg-max, taken on the batch, cut to the image's content and resized to the image's own size
(nearest: class indices are not blended); where the logits are coarser than the input, the
logits are resized to the image first and the arg-max taken there, as Hugging Face's
segmenters answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import interpolate, normalize

from app.engine.tasks.outputs import Detections
from preprocessing import Placement


@dataclass(frozen=True, slots=True)
class Detected:
    """One image's detections, best first: ``boxes`` ``[k, 4]`` (x1, y1, x2, y2 in the
    image's pixels), ``scores`` ``[k]``, ``labels`` ``[k]`` (class indices); an instance
    segmenter's ``masks`` (each box's, COCO run-length: ``{"size": [h, w], "counts": ...}``)
    and a keypoint detector's ``keypoints`` ``[k, P, 3]`` (x, y in the image's pixels,
    score)."""

    boxes: np.ndarray[Any, Any]
    scores: np.ndarray[Any, Any]
    labels: np.ndarray[Any, Any]
    masks: list[dict[str, Any]] | None = None
    keypoints: np.ndarray[Any, Any] | None = None

    def __len__(self) -> int:
        return len(self.scores)


def mapping(placements: Sequence[Placement], device: torch.device) -> torch.Tensor:
    """Per image, ``[scale_x, scale_y, left, top]``: content pixels to image pixels."""
    return torch.tensor([[p.width / p.content_width, p.height / p.content_height, p.left, p.top]
                         for p in placements], dtype=torch.float32, device=device)  # fmt: skip


def detections(
    found: Detections,
    placements: Sequence[Placement],
    min_scores: Sequence[float],
    max_counts: Sequence[int],
    nms_iou: float | None,
    with_masks: Sequence[bool] | None = None,
    clip: bool = True,
) -> list[Detected]:
    """Each image's boxes in its own pixels, clipped to it (unless not ``clip``: as
    transformers answers), those with an area scoring at least its ``min_scores`` (and above
    0: padding), suppressed at ``nms_iou`` per class when given, at most its ``max_counts``,
    best first; with their masks (where ``with_masks``) and keypoints where the model gives
    them."""
    count = len(placements)
    boxes, scores = found.boxes[:count].float(), found.scores[:count].float()
    labels = found.labels[:count]
    where = mapping(placements, boxes.device)
    scale, offset = where[:, :2].repeat(1, 2)[:, None], where[:, 2:].repeat(1, 2)[:, None]
    boxes = (boxes - offset) * scale
    limits = torch.tensor([[p.width, p.height] for p in placements], dtype=torch.float32,
                          device=boxes.device).repeat(1, 2).unsqueeze(1)  # fmt: skip
    if clip:
        boxes = torch.minimum(boxes.clamp(min=0), limits)
    area = (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
    threshold = torch.tensor(min_scores, dtype=torch.float32, device=scores.device)
    keep = (scores > 0) & area & (scores >= threshold.unsqueeze(1))
    answers = []
    for row in range(count):
        kept = keep[row].nonzero().squeeze(1)
        row_boxes, row_scores, row_labels = boxes[row, kept], scores[row, kept], labels[row, kept]
        if nms_iou is not None and len(kept):
            from torchvision.ops import batched_nms

            order = batched_nms(row_boxes, row_scores, row_labels, nms_iou)
        else:
            order = row_scores.argsort(descending=True, stable=True)
        order = order[: max_counts[row]]
        chosen = kept[order]
        masks = None
        wanted = with_masks is None or with_masks[row]
        if found.masks is not None and wanted:
            masks = run_lengths(found.masks[row, chosen], row_boxes[order], placements[row])
        elif found.coefficients is not None and found.prototypes is not None and wanted:
            boxed = prototype_masks(found.coefficients[row, chosen], found.prototypes[row],
                                    row_boxes[order], placements[row])  # fmt: skip
            filled = [bool(each.pixels.any()) for each in boxed]  # an empty mask is no box
            kept_rows = torch.tensor(filled, dtype=torch.bool, device=order.device)
            order, chosen = order[kept_rows], chosen[kept_rows]
            size = (placements[row].height, placements[row].width)
            masks = boxed_run_lengths([each for each, full in zip(boxed, filled, strict=True)
                                       if full], size)  # fmt: skip
        keypoints = None
        if found.keypoints is not None:
            points = found.keypoints[row, chosen].float().clone()
            points[..., :2] = (points[..., :2] - where[row, 2:]) * where[row, :2]
            keypoints = points.cpu().numpy()
        answers.append(Detected(
            row_boxes[order].cpu().numpy(), row_scores[order].cpu().numpy(),
            row_labels[order].to(torch.int64).cpu().numpy(), masks, keypoints,
        ))  # fmt: skip
    return answers


def run_lengths(
    masks: torch.Tensor, boxes: torch.Tensor, placement: Placement
) -> list[dict[str, Any]]:
    """Each box's mask probabilities ``[k, M, M]`` pasted into the image at its box (in the
    image's pixels), binarised at 0.5, as COCO run-length."""
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    if not len(masks):
        return []
    pasted = paste_masks_in_image(masks[:, None].float().cpu(), boxes.cpu(),
                                  (placement.height, placement.width))  # fmt: skip
    return encoded(pasted[:, 0] > 0.5)


@dataclass(frozen=True)
class BoxedMask:
    """A mask in an image's pixels given by its box's part (``pixels``, ``bool [h, w]``,
    at ``top``, ``left``): nothing of it lies outside."""

    top: int
    left: int
    pixels: torch.Tensor


def prototype_masks(
    coefficients: torch.Tensor, prototypes: torch.Tensor, boxes: torch.Tensor,
    placement: Placement,
) -> list[BoxedMask]:  # fmt: skip
    """A YOLO instance segmenter's masks in the image's pixels, as
    Ultralytics answers them with ``retina_masks``: each box's logits (its coefficients
    weighing the prototypes), brought to the input's size, the image's content cut from it
    where the placement put it (no padding), resized to the image's own size (bilinear each
    time), kept inside the box (``boxes [k, 4]`` in the image's pixels) and above 0.

    Both resizes are linear and separable: one matrix per axis (``_resampling``) takes the
    prototypes' rows (columns) to the image's, and each mask is computed only inside its box,
    not over the whole image."""
    count, (height, width) = len(coefficients), (placement.height, placement.width)
    if not count:
        return []
    device = coefficients.device
    channels, proto_height, proto_width = prototypes.shape
    canvas_height, canvas_width = placement.canvas
    rows = _resampling(proto_height, canvas_height, placement.top, placement.content_height,
                       height, device)  # fmt: skip
    columns = _resampling(proto_width, canvas_width, placement.left, placement.content_width,
                          width, device)  # fmt: skip
    logits = (coefficients.float() @ prototypes.float().reshape(channels, -1)).reshape(
        count, proto_height, proto_width
    )
    # The pixels inside a box: those whose index i has x1 <= i < x2 (and so for rows).
    spans = boxes.float().ceil().clamp(min=0).to(torch.int64).tolist()
    found = []
    for index, (x1, y1, x2, y2) in enumerate(spans):
        x2, y2 = max(min(x2, width), x1), max(min(y2, height), y1)
        inside = rows[y1:y2] @ logits[index] @ columns[x1:x2].T
        found.append(BoxedMask(y1, x1, (inside > 0).cpu()))
    return found


def _resampling(
    source: int, canvas: int, start: int, content: int, target: int, device: torch.device
) -> torch.Tensor:
    """``[target, source]``: one axis of the prototypes resized to the input canvas, the
    content's span cut from it, resized to the image's side (bilinear, without
    antialiasing, as ``interpolate`` does both)."""
    to_canvas = _bilinear(source, canvas)[start : start + content]
    return (_bilinear(content, target) @ to_canvas).to(device, torch.float32)


def _bilinear(source: int, target: int) -> torch.Tensor:
    """``[target, source]``: ``interpolate(..., mode="bilinear", align_corners=False)`` along
    one axis, as a matrix (each target sample between its two nearest sources)."""
    place = ((torch.arange(target, dtype=torch.float64) + 0.5) * (source / target) - 0.5).clamp(
        min=0
    )
    lower = place.floor().to(torch.int64).clamp(max=source - 1)
    upper = (lower + 1).clamp(max=source - 1)
    weight = place - lower
    matrix = torch.zeros((target, source), dtype=torch.float64)
    index = torch.arange(target)
    matrix.index_put_((index, lower), 1 - weight, accumulate=True)
    matrix.index_put_((index, upper), weight, accumulate=True)
    return matrix


def boxed_run_lengths(masks: Sequence[BoxedMask], size: tuple[int, int]) -> list[dict[str, Any]]:
    """Masks given by their boxes' parts as COCO run-length in an image of ``size`` (height,
    width): counted over the box's columns alone, the columns before and after it runs of
    zeros, so the whole image is never made."""
    from pycocotools import mask as coco

    height, width = size
    uncompressed = [{"size": [height, width], "counts": _counts(each, height, width)}
                    for each in masks]  # fmt: skip
    if not uncompressed:
        return []
    return [{"size": [int(each["size"][0]), int(each["size"][1])],
             "counts": each["counts"].decode("ascii")}
            for each in coco.frPyObjects(uncompressed, height, width)]  # fmt: skip


def _counts(mask: BoxedMask, height: int, width: int) -> list[int]:
    """COCO's uncompressed counts (column by column, zeros first) of one boxed mask."""
    rows, columns = mask.pixels.shape
    strip = np.zeros((height, columns), dtype=np.uint8)  # the box's columns, whole
    strip[mask.top : mask.top + rows] = mask.pixels.numpy()
    flat = strip.ravel(order="F")
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate(([0], changes, [flat.size]))).tolist()
    if flat.size and flat[0]:
        counts.insert(0, 0)
    if not counts:
        counts = [0]
    counts[0] += mask.left * height
    after = (width - mask.left - columns) * height
    if len(counts) % 2:  # the last run is of zeros
        counts[-1] += after
    elif after:
        counts.append(after)
    return [int(each) for each in counts]


def encoded(binary: torch.Tensor) -> list[dict[str, Any]]:
    """``bool [k, H, W]`` masks as COCO run-length."""
    from pycocotools import mask as coco

    if not len(binary):
        return []
    pixels = binary.permute(1, 2, 0).cpu().numpy().astype(np.uint8)
    return [{"size": [int(each["size"][0]), int(each["size"][1])],
             "counts": each["counts"].decode("ascii")}
            for each in coco.encode(np.asfortranarray(pixels))]  # fmt: skip


def masks(
    logits: torch.Tensor, placements: Sequence[Placement], resize_logits: bool = False
) -> list[np.ndarray[Any, Any]]:
    """Each image's mask of class indices, ``[H, W]`` in its own pixels: uint8 for up to 256
    classes, else uint16 (up to 65,536). Logits coarser than the input, or all of them with
    ``resize_logits``, are resized to the image before their arg-max; otherwise the classes
    at the input's resolution are cut from the canvas and resized (nearest)."""
    if resize_logits or logits.shape[-2:] != placements[0].canvas:
        return [
            _resized_classes(row, where) for row, where in zip(logits, placements, strict=False)
        ]
    # max's indices, not argmax: the same first index of the largest logit, from a faster
    # kernel on a CPU.
    classes = logits.max(dim=1).indices
    many = logits.shape[1] > 256
    classes = classes.to(torch.int32 if many else torch.uint8)
    answers = []
    for row, where in enumerate(placements):
        part = classes[row, where.top : where.top + where.content_height,
                       where.left : where.left + where.content_width]  # fmt: skip
        size = (where.height, where.width)
        if tuple(part.shape) != size:
            # Nearest has a uint8 kernel; larger indices go through float (exact below 2**24).
            source = part[None, None].float() if many else part[None, None]
            part = interpolate(source, size=size, mode="nearest")[0, 0].to(part.dtype)
        mask = part.cpu().numpy()
        answers.append(mask.astype(np.uint16) if many else mask)
    return answers


# The most bytes of resized logits held at once.
LOGIT_BAND_BYTES = 16 * 1024 * 1024


def _resized_classes(logits: torch.Tensor, where: Placement) -> np.ndarray[Any, Any]:
    """The mask of a model whose logits ``[C, h, w]`` are coarser than its input (SegFormer's
    are a quarter of it), or of any transformers segmenter, as Hugging Face's
    ``post_process_semantic_segmentation`` makes it: the logits resized to the image's size
    (bilinear) and their arg-max there; resized directly where the image fills the input, else
    to the input and the image's content cut from it first. A band of rows at a time, so that
    ``C`` planes of the image's size are never whole."""
    channels, height, width = logits.shape
    canvas_height, canvas_width = where.canvas
    device = logits.device
    if (where.content_height, where.content_width) == where.canvas:
        rows = _bilinear(height, where.height).to(device, torch.float32)
        columns = _bilinear(width, where.width).to(device, torch.float32)
    else:
        rows = _resampling(height, canvas_height, where.top, where.content_height, where.height,
                           device)  # fmt: skip
        columns = _resampling(width, canvas_width, where.left, where.content_width, where.width,
                              device)  # fmt: skip
    across = logits.float() @ columns.T  # [C, h, W]
    band = max(1, LOGIT_BAND_BYTES // (4 * channels * where.width))
    classes = torch.empty((where.height, where.width), dtype=torch.int64, device=device)
    for top in range(0, where.height, band):
        resized = torch.einsum("bh,chw->cbw", rows[top : top + band], across)
        classes[top : top + band] = resized.max(dim=0).indices
    mask = classes.cpu().numpy()
    return mask.astype(np.uint16 if channels > 256 else np.uint8)


def embeddings(features: torch.Tensor, normalized: bool) -> np.ndarray[Any, Any]:
    """FP32 ``[N, D]``, each row of unit length when ``normalized``."""
    features = features.float()
    if normalized:
        features = normalize(features, dim=1)
    return features.cpu().numpy()

"""What a task's model must return from its forward pass, read into batched tensors.

- ``classify``: logits ``[N, classes]``;
- ``embed``: features ``[N, D]`` (an encoder's, or a classifier's penultimate layer);
- ``segment``: logits ``[N, C, H, W]``, or torchvision's ``{"out": logits, ...}``;
- ``detect``: a tuple ``(boxes [N, K, 4], scores [N, K], labels [N, K])`` with boxes ``x1, y1,
  x2, y2`` in the input's pixels and a score of 0 for padding, or torchvision's list of one
  dict per image (``boxes``, ``scores``, ``labels``; Mask R-CNN's ``masks``, each box's
  probabilities ``[1, M, M]`` before they are pasted into the image; Keypoint R-CNN's
  ``keypoints [P, 3]`` and ``keypoints_scores [P]``).

A model whose outputs do not fit its task stops the start with one line saying what was
expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch


class Detections(NamedTuple):
    """A batch's detections, padded to the most any image has (a score of 0 pads): ``boxes
    [N, K, 4]`` (x1, y1, x2, y2 in the input's pixels), ``scores [N, K]``, ``labels [N, K]``;
    an instance segmenter's ``masks [N, K, M, M]`` (each box's mask probabilities, in the box);
    a keypoint detector's ``keypoints [N, K, P, 3]`` (x, y in the input's pixels, and each
    keypoint's score); a YOLO instance segmenter's mask ``coefficients [N, K, C]`` of each box
    and each image's ``prototypes [N, C, H/4, W/4]`` over its whole input, whose weighted sum
    is the box's mask logits."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor | None = None
    keypoints: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    prototypes: torch.Tensor | None = None


EXPECTED = {
    "classify": "logits of shape [batch, classes]",
    "embed": "features of shape [batch, dimensions]",
    "segment": "logits of shape [batch, classes, height, width] (or {'out': logits})",
    "detect": "(boxes [batch, K, 4], scores [batch, K], labels [batch, K]) or a list of "
    "{'boxes', 'scores', 'labels'} per image",
}


class OutputMismatchError(ValueError):
    """The model's outputs do not fit its task."""


def detections(output: Any) -> Detections:
    """A detector's output as padded ``(boxes, scores, labels)``: ``[N, K, 4]``, ``[N, K]``,
    ``[N, K]`` (K at least 1; a score of 0 pads)."""
    if isinstance(output, Sequence) and output and all(isinstance(o, Mapping) for o in output):
        return _padded(output)
    if isinstance(output, Detections):
        return output
    if (isinstance(output, Sequence) and len(output) == 3
            and all(isinstance(o, torch.Tensor) for o in output)):  # fmt: skip
        boxes, scores, labels = output[:3]
        n = boxes.shape[0] if boxes.ndim == 3 else -1
        if (boxes.ndim == 3 and boxes.shape[-1] == 4 and scores.shape == boxes.shape[:2]
                and labels.shape == boxes.shape[:2]):  # fmt: skip
            return Detections(boxes, scores, labels, *output[3:])
        raise OutputMismatchError(
            f"boxes {tuple(boxes.shape)}, scores {tuple(scores.shape)} and labels "
            f"{tuple(labels.shape)} do not fit (boxes [N, K, 4] with N={n})"
        )
    raise OutputMismatchError(f"got {_described(output)}")


def _padded(per_image: Sequence[Mapping[str, torch.Tensor]]) -> Detections:
    count = max(1, *(len(each["scores"]) for each in per_image))
    n = len(per_image)
    first = per_image[0]
    device = first["boxes"].device
    boxes = torch.zeros((n, count, 4), dtype=torch.float32, device=device)
    scores = torch.zeros((n, count), dtype=torch.float32, device=device)
    labels = torch.zeros((n, count), dtype=torch.int64, device=device)
    masks = keypoints = None
    if "masks" in first:  # [k, 1, M, M] each
        masks = torch.zeros((n, count, *first["masks"].shape[-2:]), device=device)
    if "keypoints" in first:  # [k, P, 3] and [k, P] each
        keypoints = torch.zeros((n, count, first["keypoints"].shape[1], 3), device=device)
    for row, each in enumerate(per_image):
        found = len(each["scores"])
        boxes[row, :found] = each["boxes"].float()
        scores[row, :found] = each["scores"].float()
        labels[row, :found] = each["labels"].to(torch.int64)
        if masks is not None:
            masks[row, :found] = each["masks"][:, 0].float()
        if keypoints is not None:
            keypoints[row, :found, :, :2] = each["keypoints"][..., :2].float()
            keypoints[row, :found, :, 2] = each["keypoints_scores"].float()
    return Detections(boxes, scores, labels, masks, keypoints)


def instances_of(output: Any) -> tuple[str, ...]:
    """What a detector gives of each box beside it: ``masks`` (Mask R-CNN), ``keypoints``
    (Keypoint R-CNN)."""
    found = detections(output)
    masks = found.masks is not None or found.coefficients is not None
    return ("masks",) * masks + ("keypoints",) * (found.keypoints is not None)


def segmentation(output: Any) -> torch.Tensor:
    """A segmenter's logits ``[N, C, H, W]``."""
    if isinstance(output, Mapping) and "out" in output:
        output = output["out"]
    if isinstance(output, torch.Tensor) and output.ndim == 4:
        return output
    raise OutputMismatchError(f"got {_described(output)}")


def vectors(output: Any) -> torch.Tensor:
    """Logits or features ``[N, D]``."""
    if isinstance(output, torch.Tensor) and output.ndim == 2:
        return output
    raise OutputMismatchError(f"got {_described(output)}")


def output_size(task: str, output: Any, name: str) -> int:
    """What the probe's output says of the model: its classes (classify, segment), its
    dimensions (embed), or 0 (detect: labels name the classes); ``OutputMismatchError`` with
    what was expected when it does not fit the task."""
    try:
        if task == "detect":
            detections(output)
            return 0
        if task == "segment":
            return int(segmentation(output).shape[1])
        return int(vectors(output).shape[1])
    except OutputMismatchError as exc:
        raise mismatch(task, name, exc) from None


def mismatch(task: str, name: str, found: OutputMismatchError) -> OutputMismatchError:
    """The one line that says what ``task`` expected of ``name`` and what it got."""
    return OutputMismatchError(
        f"{name} is served as TASK={task} and must return {EXPECTED[task]}: {found}"
    )


def _described(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {list(output.shape)}"
    if isinstance(output, Mapping):
        return f"a mapping of {sorted(map(str, output))}"
    if isinstance(output, Sequence):
        return f"a sequence of {len(output)}"
    return type(output).__name__

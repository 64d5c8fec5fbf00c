"""Ultralytics YOLO models, served as Ultralytics' predictor answers them.

The network runs to its raw head (``YoloGraph``): ``[N, 4 + classes + extra, A]`` over every
anchor point ``A`` of every level, each column a box as centre x, y, width and height in the
input's pixels, the classes' scores (after their sigmoid) and, for a pose model, each
keypoint's x, y (input pixels) and visibility. Ultralytics documents this as the output of
its exports. ``YoloDecode`` is the rest, in PyTorch, for the whole batch at once, as the
documented ``predict`` defaults describe it: each anchor's best class, those scoring above the
floor, class-aware non-maximum suppression per image at ``iou`` (0.7), at most ``max_det``
(300) best first; boxes converted to corners. The input is Ultralytics' letterbox
(``preprocessing.placement``'s ``centered-letterbox``: grey 114, RGB scaled to [0, 1], no mean
or std), and the server maps boxes and keypoints back from it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from app.engine.tasks.outputs import Detections
from preprocessing import Fit, TransformConfig
from preprocessing.transforms import Resampler

# Ultralytics' task names, and what each is served as here.
SERVED_TASKS = {"detect": "detect", "pose": "detect", "segment": "detect", "classify": "classify"}
PREDICT_IOU = 0.7  # Ultralytics' predict default
PREDICT_MAX_DET = 300
# The lowest score decoded: requests choose theirs (?min_score=) above it. Greedy suppression
# keeps the same boxes above any threshold whatever the floor beneath it.
SCORE_FLOOR = 0.001
PAD_GREY = 114

# Boxes, scores and labels of the candidate rows, their extra columns (keypoints or mask
# coefficients), and which rows each image answers, best first.
_Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]


def ultralytics_model(module: Any) -> bool:
    """Whether ``module`` is an Ultralytics model (``DetectionModel`` and its kin)."""
    return type(module).__module__.startswith("ultralytics.") and hasattr(module, "task")


def yolo_transform(imgsz: int, stride: int = 32) -> TransformConfig:
    """Ultralytics' predictor input for a lone image: the centred letterbox fitting it into
    ``imgsz``, padded to the ``stride`` with grey 114, bilinear on the uint8 image without
    antialiasing (by OpenCV, as Ultralytics resizes, where it is installed: the ``yolo``
    extra brings it), [0, 1] with no mean or std."""
    return TransformConfig(
        crop_size=imgsz, resize_size=imgsz, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
        fit=Fit.CENTERED_LETTERBOX, size_divisible=stride, antialias=False, float_resize=False,
        fill=PAD_GREY / 255, resampler=Resampler.OPENCV if _has_opencv() else Resampler.TORCH,
    )  # fmt: skip


def yolo_classify_transform(imgsz: int) -> TransformConfig:
    """Ultralytics' classification input: the shorter side to ``imgsz`` (Pillow's bilinear,
    as torchvision's ``Resize`` on a PIL image), its centre square, [0, 1] with no mean or
    std."""
    return TransformConfig(crop_size=imgsz, resize_size=imgsz, mean=(0.0, 0.0, 0.0),
                           std=(1.0, 1.0, 1.0), fit=Fit.CENTER_CROP,
                           resampler=Resampler.PILLOW)  # fmt: skip


def _has_opencv() -> bool:
    return importlib.util.find_spec("cv2") is not None


def head_tensors(output: Any) -> tuple[torch.Tensor, ...]:
    """The raw head ``[N, 4 + classes + extra, A]`` of what a YOLO model returns, and an
    instance segmenter's prototypes ``[N, C, H/4, W/4]`` after it: an export's ``head`` or
    ``(head, prototypes)``, or the first of eager Ultralytics' ``(outputs, extras)``."""
    while isinstance(output, list | tuple) and output and not isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return (output,)
    if not isinstance(output, list | tuple) or not output:
        raise ValueError(f"a YOLO model answered {type(output).__name__}, not its head")
    second = output[1] if len(output) > 1 else None
    if isinstance(second, torch.Tensor) and second.ndim == 4:
        return (output[0], second)
    return (output[0],)


class YoloGraph(nn.Module):
    """The network to its raw head: ``[N, 3, S, S]`` to ``[N, 4 + classes + extra, A]`` (and
    an instance segmenter's prototypes)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        layers = getattr(model, "model", None)
        head = layers[-1] if isinstance(layers, nn.Sequential) else None
        if head is not None and hasattr(head, "dynamic"):
            # Its anchor points made on every call, not kept from the last input's shape: the
            # graph then exports with a free batch and canvas, and threads share no state.
            setattr(head, "dynamic", True)  # noqa: B010 - a plain attribute of theirs

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return head_tensors(self.model(batch))

    @property
    def exportable(self) -> bool:
        """Whether a runtime can be given it: a TorchScript export runs on PyTorch alone."""
        return not isinstance(self.model, torch.jit.ScriptModule)


class YoloDecode:
    """Ultralytics' predict decoding of the raw head, for a batch: ``classes`` class scores
    after the box, then per anchor a pose model's ``keypoints`` (``(P, 3)``: x, y,
    visibility; or ``(P, 2)``, answered with a visibility of 1) or an instance segmenter's
    mask coefficients (``masks``; its prototypes the graph's second output). An end-to-end
    head (YOLOv10's and YOLO26's one-to-one branch, where the file selects it) answers its
    rows ready, without suppression: Ultralytics then only drops those under the score."""

    def __init__(
        self,
        classes: int,
        keypoints: tuple[int, int] | None = None,
        iou: float = PREDICT_IOU,
        max_det: int = PREDICT_MAX_DET,
        masks: bool = False,
        end_to_end: bool = False,
    ) -> None:
        self.classes = classes
        self.keypoints = keypoints
        self.iou = iou
        self.max_det = max_det
        self.masks = masks  # an instance segmenter: mask coefficients after the classes
        self.end_to_end = end_to_end  # a head that answers its own top rows (no suppression)

    def __call__(
        self,
        outputs: Sequence[torch.Tensor],
        canvas: tuple[int, int] | None = None,
        sizes: Sequence[tuple[int, int]] | None = None,
    ) -> Detections:
        rows = self._ranked(outputs[0]) if self.end_to_end else self._suppressed(outputs[0])
        boxes, scores, labels, extra, per_image = rows
        images = len(per_image)
        count = max(1, *(len(each) for each in per_image)) if images else 1
        padded_boxes = boxes.new_zeros((images, count, 4))
        padded_scores = boxes.new_zeros((images, count))
        padded_labels = torch.zeros((images, count), dtype=torch.int64, device=boxes.device)
        points, shape = None, self.keypoints
        if shape is not None:
            points = boxes.new_ones((images, count, shape[0], 3))
        coefficients = prototypes = None
        if self.masks:
            prototypes = outputs[1]
            coefficients = boxes.new_zeros((images, count, extra.shape[1]))
        for row, chosen in enumerate(per_image):
            found = len(chosen)
            padded_boxes[row, :found] = boxes[chosen]
            padded_scores[row, :found] = scores[chosen]
            padded_labels[row, :found] = labels[chosen]
            if points is not None and shape is not None:
                points[row, :found, :, : shape[1]] = extra[chosen].reshape(found, *shape)
            if coefficients is not None:
                coefficients[row, :found] = extra[chosen]
        return Detections(padded_boxes, padded_scores, padded_labels, None, points,
                          coefficients, prototypes)  # fmt: skip

    def _suppressed(self, output: torch.Tensor) -> _Rows:
        """The raw head ``[N, 4 + classes + extra, A]``: each anchor's best class, those above
        the floor, suppressed per image and class, best first."""
        from torchvision.ops import batched_nms

        head = output.float().transpose(1, 2)  # [N, A, 4 + classes + extra]
        scores, labels = head[..., 4 : 4 + self.classes].max(dim=2)
        image, anchor = (scores > SCORE_FLOOR).nonzero(as_tuple=True)
        chosen = head[image, anchor]
        boxes, scores, labels = corners(chosen[:, :4]), scores[image, anchor], labels[image, anchor]
        # One suppression for the whole batch: a group per image and class.
        kept = batched_nms(boxes, scores, image * self.classes + labels, self.iou)  # best first
        per_image = [kept[image[kept] == row][: self.max_det] for row in range(head.shape[0])]
        return boxes, scores, labels, chosen[:, 4 + self.classes :], per_image

    def _ranked(self, output: torch.Tensor) -> _Rows:
        """An end-to-end head ``[N, K, 6 + extra]``: its rows are the answer, best first, as
        corners, score and class; those above the floor are taken as they are."""
        head = output.float()
        flat = head.reshape(-1, head.shape[2])
        scores = flat[:, 4]
        above = (scores > SCORE_FLOOR).reshape(head.shape[:2])
        starts = torch.arange(head.shape[0], device=head.device) * head.shape[1]
        per_image = [start + row.nonzero().flatten()[: self.max_det]
                     for start, row in zip(starts, above, strict=True)]  # fmt: skip
        return flat[:, :4], scores, flat[:, 5].long(), flat[:, 6:], per_image


def corners(xywh: torch.Tensor) -> torch.Tensor:
    """Centre x, y, width, height to x1, y1, x2, y2."""
    centre, half = xywh[:, :2], xywh[:, 2:] / 2
    return torch.cat((centre - half, centre + half), dim=1)


class YoloDetector(nn.Module):
    """A YOLO detection or pose model taking the server's batch: its graph, then its
    decoding."""

    takes_sizes = True

    def __init__(self, graph: nn.Module, decoding: YoloDecode) -> None:
        super().__init__()
        self.graph = graph
        self.decoding = decoding

    def forward(
        self, batch: torch.Tensor, sizes: Sequence[tuple[int, int]] | None = None
    ) -> Detections:
        return self.decoding(list(self.graph(batch)))

    @property
    def exportable(self) -> bool:
        return bool(self.graph.exportable) if isinstance(self.graph, YoloGraph) else True


class YoloClassifier(nn.Module):
    """A YOLO classifier, whose head answers probabilities, answering their logarithms: the
    server's softmax then gives back Ultralytics' own probabilities."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        (probabilities, *_) = head_tensors(self.model(batch))
        return probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny).log()

    @property
    def exportable(self) -> bool:
        return not isinstance(self.model, torch.jit.ScriptModule)

"""Hugging Face transformers' vision models made to take the server's batch and answer as
their own pipelines do.

Each wraps the model's forward pass on ``pixel_values`` and returns the tensors its task
serves: a classifier's ``logits``; an encoder's vector (the projected ``image_embeds`` of a
CLIP-like tower, else its ``pooler_output``, else the first token of its last hidden
state); a segmenter's ``logits`` (at the model's own resolution, often a quarter of the
input: the server resizes them to each image as ``post_process_semantic_segmentation``
does); a detector's ``logits`` and ``pred_boxes``, decoded by the image processor's own
``post_process_object_detection`` told each image's size in the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from app.engine.tasks.outputs import Detections, detections

ImageSizes = Sequence[tuple[int, int]]


class HfLogits(nn.Module):
    """A classifier's logits (``AutoModelForImageClassification``), or a segmenter's at the
    model's own resolution (``AutoModelForSemanticSegmentation``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(pixel_values=batch).logits
        return logits


class HfEncoder(nn.Module):
    """A vision tower's image vector: what its model card documents as the image's
    embedding."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # A two-tower model (CLIP, SigLIP) answers its image tower's projection.
        self.image_features = hasattr(model, "get_image_features")

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.image_features:
            output: Any = self.model.get_image_features(pixel_values=batch)  # type: ignore[operator]
        else:
            output = self.model(pixel_values=batch)
        return vector_of(output)


def vector_of(output: Any) -> torch.Tensor:
    """The image vector of a model's output: ``image_embeds``, ``pooler_output`` or the first
    token of ``last_hidden_state``."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("image_embeds", "pooler_output"):
        found = getattr(output, name, None)
        if isinstance(found, torch.Tensor):
            return found.flatten(1)
    hidden: torch.Tensor = output.last_hidden_state
    return hidden[:, 0]


class HfDetectorGraph(nn.Module):
    """An object detector's forward pass: ``(logits, pred_boxes)``; ``pixel_mask`` (the pixels
    that are image, not padding) where the model takes one and some image of the batch does
    not fill its canvas."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, batch: torch.Tensor, pixel_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        extra = {} if pixel_mask is None else {"pixel_mask": pixel_mask}
        output = self.model(pixel_values=batch, **extra)
        return output.logits, output.pred_boxes


class HfDetections:
    """The image processor's ``post_process_object_detection`` on a batch's outputs: each
    image's boxes in its own size in the input (its content), every score above
    ``threshold`` (the server's own threshold applies after)."""

    def __init__(self, processor: Any, threshold: float = 0.0) -> None:
        self.processor = processor
        self.threshold = threshold

    def __call__(
        self, outputs: Sequence[torch.Tensor], canvas: tuple[int, int], sizes: ImageSizes | None
    ) -> Detections:
        logits, boxes = outputs[0], outputs[1]
        count = int(logits.shape[0])
        targets = list(sizes)[:count] if sizes is not None else [canvas] * count
        found = self.processor.post_process_object_detection(
            SimpleNamespace(logits=logits.float(), pred_boxes=boxes.float()),
            threshold=self.threshold,
            target_sizes=torch.tensor(targets, dtype=torch.float32),
        )
        return detections(found)


class HfDetector(nn.Module):
    """A Hugging Face object detector taking the server's batch ``[N, 3, H, W]`` and each
    image's own size in it: its graph, then its processor's decoding."""

    takes_sizes = True

    def __init__(self, model: nn.Module, processor: Any, takes_mask: bool) -> None:
        super().__init__()
        self.graph = HfDetectorGraph(model)
        self.decoding = HfDetections(processor)
        self.takes_mask = takes_mask

    def forward(self, batch: torch.Tensor, sizes: ImageSizes | None = None) -> Detections:
        canvas = (int(batch.shape[-2]), int(batch.shape[-1]))
        mask = None
        if self.takes_mask and sizes is not None and any(size != canvas for size in sizes):
            mask = pixel_mask(batch, sizes)
        return self.decoding(self.graph(batch, mask), canvas, sizes)


def pixel_mask(batch: torch.Tensor, sizes: ImageSizes) -> torch.Tensor:
    """``int64[N, H, W]``: 1 where each image's pixels lie (the top left of its canvas, as
    the image processor pads), 0 in the padding."""
    mask = torch.zeros((batch.shape[0], *batch.shape[-2:]), dtype=torch.int64,
                       device=batch.device)  # fmt: skip
    for row, (height, width) in enumerate(sizes):
        mask[row, :height, :width] = 1
    return mask

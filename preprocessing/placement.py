"""Where an image lies in its model's input: the one account of each image's geometry.

A model's library says how an image becomes its input (``Fit``); the size of the upright image
then decides everything else (``placement``): the size its pixels are resized to (its
*content*), the size of the tensor they are placed in (its *canvas*, padded where the model
pads), and where in the canvas they lie. The same ``Placement`` decides the resize, the batch
an image may share (images share a batch only with images of the same canvas, so that each
gets the tensor it would get alone), and the mapping of the model's answers back to the
image's own pixels; it is worked out once, from the image's header, and never again from a
decoded (maybe smaller) picture.

The rules, each as its library computes it:

- ``center-crop``: torchvision's classification preset, ``Resize(resize_size)`` (the shorter
  side to ``resize_size``, the longer ``int(resize_size * long / short)``) then
  ``CenterCrop(crop_size)``; answers are in the crop's pixels.
- ``shorter-side``: torchvision's ``Resize(resize_size)`` alone (its segmentation preset): the
  whole image, of its own aspect ratio.
- ``min-max``: a torchvision detector's ``GeneralizedRCNNTransform``: scaled by
  ``min(min_size / short, max_size / long)``, each side ``floor(side * scale)``, padded at the
  bottom and right to a multiple of ``size_divisible``.
- ``shortest-longest``: a Hugging Face image processor's ``{"shortest_edge", "longest_edge"}``
  (DETR and its kin): the shorter side to ``resize_size`` unless the longer would pass
  ``max_size``, then the shorter side ``round(max_size * short / long)``; the longer side
  truncated, as ``get_size_with_aspect_ratio`` computes it.
- ``stretch``: to a fixed ``crop_size`` square, the aspect ratio not kept (SSD, SSDlite).
- ``letterbox``: the longer side to ``crop_size``, the shorter rounded, placed at the top left
  of the ``crop_size`` square (for a model trained that way: one of one's own).
- ``centered-letterbox``: Ultralytics' ``LetterBox`` as its predictor applies it to a lone
  image: scaled by ``min(crop_size / height, crop_size / width)``, each side rounded (at least
  1), padded to a multiple of ``size_divisible`` (the model's stride: its "minimum
  rectangle") with the content centred (the padding before it ``round(pad / 2 - 0.1)``, as
  Ultralytics rounds it). In a shared canvas the content is centred in it, as Ultralytics
  centres each image of a batch of mixed sizes in its square.

Shared canvases (``buckets``, opt-in): where a rule's canvas follows the image's shape, an image
may instead be padded at the bottom and right into the smallest of a few given canvases that
holds its own, so that images of different shapes batch together. Its content is unchanged
and the model is told its size, but a model that pools over its whole input (squeeze-and-
excitation, ASPP) sees the padding: its answers can differ from the image's answers alone.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Fit(enum.StrEnum):
    """How an image is fitted to a model's input (see the module's docstring)."""

    CENTER_CROP = "center-crop"
    SHORTER_SIDE = "shorter-side"
    MIN_MAX = "min-max"
    SHORTEST_LONGEST = "shortest-longest"
    STRETCH = "stretch"
    LETTERBOX = "letterbox"
    CENTERED_LETTERBOX = "centered-letterbox"

    @property
    def whole_image(self) -> bool:
        """Whether the model sees the whole image (its answers then map to its pixels)."""
        return self is not Fit.CENTER_CROP

    @property
    def fixed_canvas(self) -> bool:
        """Whether every image gets the same canvas, whatever its size."""
        return self in (Fit.CENTER_CROP, Fit.STRETCH, Fit.LETTERBOX)


@dataclass(frozen=True, slots=True)
class Placement:
    """One image in its model's input: its upright size, the size of its resized pixels
    (``content``), the input tensor's size (``canvas``, the batch key) and where the content
    lies in it (``top``, ``left``); answers map from content pixels to image pixels."""

    width: int
    height: int
    content_width: int
    content_height: int
    canvas_width: int
    canvas_height: int
    top: int = 0
    left: int = 0

    @property
    def canvas(self) -> tuple[int, int]:
        """``(height, width)`` of the input tensor: images batch together only with equal ones."""
        return self.canvas_height, self.canvas_width

    @property
    def content(self) -> tuple[int, int]:
        """``(height, width)`` of the image's resized pixels."""
        return self.content_height, self.content_width

    @property
    def padded(self) -> bool:
        return self.content != self.canvas


def resized_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """torchvision's ``Resize(short_side)``: the shorter side at ``short_side``, the longer
    ``int(short_side * long / short)``."""
    if height <= width:
        return short_side, int(short_side * width / height)
    return int(short_side * height / width), short_side


def min_max_size(height: int, width: int, min_size: int, max_size: int | None) -> tuple[int, int]:
    """``GeneralizedRCNNTransform``'s resized size: ``floor(side * scale)`` with ``scale =
    min(min_size / short, max_size / long)``, as ``interpolate`` computes it."""
    scale = min_size / min(height, width)
    if max_size is not None:
        scale = min(scale, max_size / max(height, width))
    return math.floor(height * scale), math.floor(width * scale)


def shortest_longest_size(
    height: int, width: int, shortest: int, longest: int | None
) -> tuple[int, int]:
    """Hugging Face's ``get_size_with_aspect_ratio``: the shorter side to ``shortest`` unless
    the longer would pass ``longest`` (then to ``round(longest * short / long)``), the longer
    side scaled from the unrounded shorter one and truncated."""
    short, long = min(height, width), max(height, width)
    exact = float(shortest)
    if longest is not None and long / short * shortest > longest:
        exact = longest * short / long
        shortest = round(exact)
    if short == shortest:
        return height, width
    if width < height:
        return int(exact * height / width), shortest
    return shortest, int(exact * width / height)


def letterbox_size(height: int, width: int, size: int) -> tuple[int, int]:
    """A ``height`` x ``width`` image fitted into a ``size`` square, its aspect ratio kept:
    its longer side becomes ``size``, the shorter one is rounded (at least 1)."""
    scale = size / max(height, width)
    return max(1, min(size, round(height * scale))), max(1, min(size, round(width * scale)))


def padded_to(side: int, divisible: int) -> int:
    """``side`` rounded up to a multiple of ``divisible``."""
    return side + (-side % divisible)


def shared_canvas(canvas: tuple[int, int], buckets: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The smallest of ``buckets`` (``(height, width)``) that holds ``canvas``; the canvas
    itself where none does."""
    holding = [bucket for bucket in buckets if bucket[0] >= canvas[0] and bucket[1] >= canvas[1]]
    return min(holding, key=lambda bucket: (bucket[0] * bucket[1], bucket)) if holding else canvas


def place(
    width: int,
    height: int,
    fit: Fit,
    *,
    crop_size: int,
    resize_size: int,
    max_size: int | None = None,
    size_divisible: int = 1,
    buckets: tuple[tuple[int, int], ...] = (),
) -> Placement:
    """Where a ``width`` x ``height`` upright image lies in the input of a model fitted by
    ``fit`` (see the module's docstring for each rule), in the smallest of ``buckets`` that
    holds its own canvas where any does."""
    if fit is Fit.CENTER_CROP:
        return Placement(crop_size, crop_size, crop_size, crop_size, crop_size, crop_size)
    if fit is Fit.STRETCH:
        return Placement(width, height, crop_size, crop_size, crop_size, crop_size)
    if fit is Fit.LETTERBOX:
        content_height, content_width = letterbox_size(height, width, crop_size)
        return Placement(width, height, content_width, content_height, crop_size, crop_size)
    if fit is Fit.CENTERED_LETTERBOX:
        content_height, content_width = letterbox_size(height, width, crop_size)
        canvas_height, canvas_width = shared_canvas((
            content_height + (crop_size - content_height) % size_divisible,
            content_width + (crop_size - content_width) % size_divisible,
        ), buckets)  # fmt: skip
        top = round((canvas_height - content_height) / 2 - 0.1)
        left = round((canvas_width - content_width) / 2 - 0.1)
        return Placement(width, height, content_width, content_height, canvas_width,
                         canvas_height, top, left)  # fmt: skip
    if fit is Fit.MIN_MAX:
        content_height, content_width = min_max_size(height, width, resize_size, max_size)
    elif fit is Fit.SHORTEST_LONGEST:
        content_height, content_width = shortest_longest_size(height, width, resize_size,
                                                              max_size)  # fmt: skip
    else:
        content_height, content_width = resized_size(height, width, resize_size)
        short, long = sorted((content_height, content_width))
        if max_size is not None and long > max_size:
            # torchvision's Resize(max_size=): the longer side capped, the shorter scaled down.
            short, long = int(max_size * short / long), max_size
            content_height, content_width = (long, short) if height > width else (short, long)
    canvas_height, canvas_width = shared_canvas(
        (padded_to(content_height, size_divisible), padded_to(content_width, size_divisible)),
        buckets,
    )
    return Placement(
        width, height, content_width, content_height, canvas_width, canvas_height
    )  # fmt: skip

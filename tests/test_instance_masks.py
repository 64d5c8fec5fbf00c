"""A YOLO instance segmenter's masks made inside their boxes only: the same pixels as the
prototypes resized over the whole image, and the same COCO run-length as pycocotools gives
the whole mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pycocotools import mask as coco
from torch.nn.functional import interpolate

from app.engine.tasks.answers import BoxedMask, boxed_run_lengths, encoded, prototype_masks
from app.engine.tasks.yolo import yolo_transform
from preprocessing import Placement


def whole_image(
    coefficients: torch.Tensor, prototypes: torch.Tensor, boxes: torch.Tensor, where: Placement
) -> torch.Tensor:
    """The masks as Ultralytics' retina masks are described: logits to the canvas, the content
    cut, to the image's size, inside the box, above 0 (every pixel of the image computed)."""
    top, left = where.top, where.left
    bottom, right = top + where.content_height, left + where.content_width
    height, width = where.height, where.width
    channels, proto_height, proto_width = prototypes.shape
    logits = (coefficients @ prototypes.reshape(channels, -1)).reshape(1, -1, proto_height,
                                                                       proto_width)  # fmt: skip
    canvas = interpolate(logits, size=where.canvas, mode="bilinear")
    image = interpolate(canvas[:, :, top:bottom, left:right], size=(height, width),
                        mode="bilinear")[0]  # fmt: skip
    columns = torch.arange(width, dtype=torch.float32)
    rows = torch.arange(height, dtype=torch.float32)[:, None]
    x1, y1, x2, y2 = (each[:, None, None] for each in boxes.unbind(1))
    return (image > 0) & (columns >= x1) & (columns < x2) & (rows >= y1) & (rows < y2)


@pytest.mark.parametrize(("width", "height"), [(1024, 768), (500, 333), (375, 500), (33, 1001)])
def test_masks_inside_their_boxes_are_the_whole_images(width: int, height: int) -> None:
    generator = torch.Generator().manual_seed(width)
    placement = yolo_transform(640).placement(width, height)
    prototypes = torch.randn(32, placement.canvas[0] // 4, placement.canvas[1] // 4,
                             generator=generator)  # fmt: skip
    coefficients = torch.randn(40, 32, generator=generator) * 0.3
    size = torch.tensor([width, height], dtype=torch.float32)
    corner = torch.rand(40, 2, generator=generator) * size
    extent = torch.rand(40, 2, generator=generator) * size / 3
    boxes = torch.cat([corner, (corner + extent).minimum(size)], dim=1)
    boxes[0] = torch.tensor([0.0, 0.0, width, height])  # the whole image
    boxes[1] = torch.tensor([width - 0.5, height - 0.5, width, height])  # its last pixel
    boxes[2] = torch.tensor([10.0, 10.0, 10.0, 20.0])  # no area

    expected = whole_image(coefficients, prototypes, boxes, placement)
    found = prototype_masks(coefficients, prototypes, boxes, placement)
    pasted = torch.zeros_like(expected)
    for row, mask in enumerate(found):
        rows, columns = mask.pixels.shape
        pasted[row, mask.top : mask.top + rows, mask.left : mask.left + columns] = mask.pixels
    # The same arithmetic as two matrices: a pixel whose logit is 0 to rounding may differ.
    assert int((pasted != expected).sum()) <= 2
    assert int(expected.sum()) > 1000
    assert encoded(pasted) == boxed_run_lengths(found, (height, width))


def test_run_lengths_of_boxed_masks_are_pycocotools_own() -> None:
    generator = np.random.default_rng(0)
    height, width = 37, 53
    cases = [
        BoxedMask(0, 0, torch.ones(height, width, dtype=torch.bool)),  # everything
        BoxedMask(36, 52, torch.ones(1, 1, dtype=torch.bool)),  # the last pixel alone
        BoxedMask(0, 0, torch.ones(1, 1, dtype=torch.bool)),  # the first pixel alone
        BoxedMask(5, 7, torch.zeros(4, 3, dtype=torch.bool)),  # empty
        *(BoxedMask(int(top), int(left), torch.from_numpy(generator.random((9, 11)) > 0.5))
          for top, left in generator.integers(0, [height - 9, width - 11], size=(20, 2))),
    ]  # fmt: skip
    whole = np.zeros((height, width, len(cases)), dtype=np.uint8, order="F")
    for index, mask in enumerate(cases):
        rows, columns = mask.pixels.shape
        whole[mask.top : mask.top + rows, mask.left : mask.left + columns, index] = mask.pixels
    expected = [{"size": [height, width], "counts": each["counts"].decode("ascii")}
                for each in coco.encode(whole)]  # fmt: skip
    assert boxed_run_lengths(cases, (height, width)) == expected

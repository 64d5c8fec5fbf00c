"""RoIAlign as matrix products (``tasks.roi_pool``) answers what ``torchvision.ops.roi_align``
answers: regions inside, across and beyond the map's edges, thinner than a pixel, with fixed
and adaptive sampling, of several images at once."""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import roi_align

from app.engine.tasks.roi_pool import CHUNK, roi_align_bins


def regions(count: int, generator: torch.Generator) -> torch.Tensor:
    """``[count, 4]`` boxes around and beyond a 144 x 208 px image: some thinner than a pixel
    of the map, some wholly outside it."""
    corners = torch.rand((count, 4), generator=generator) * 320 - 60
    boxes = torch.cat([torch.minimum(corners[:, :2], corners[:, 2:]),
                       torch.maximum(corners[:, :2], corners[:, 2:])], dim=1)  # fmt: skip
    if count > 4:
        boxes[:4, 2:] = boxes[:4, :2] + 0.3
        boxes[4] = torch.tensor([400.0, 500.0, 450.0, 560.0])
    return boxes


@pytest.mark.parametrize("sampling_ratio", [2, 0, 3])
@pytest.mark.parametrize("output_size", [(7, 7), (5, 3)])
def test_pooling_answers_torchvisions_roi_align(
    sampling_ratio: int, output_size: tuple[int, int]
) -> None:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn((3, 6, 9, 13), generator=generator)
    # More regions in an image than one chunk pools, and an image without any.
    boxes = [regions(CHUNK + 9, generator), regions(0, generator), regions(11, generator)]
    rois = torch.cat([torch.cat([torch.full((len(each), 1), float(image)), each], dim=1)
                      for image, each in enumerate(boxes)])  # fmt: skip
    want = roi_align(features, rois, output_size, 1 / 16, sampling_ratio, False)
    got = roi_align_bins(features.contiguous(memory_format=torch.channels_last), boxes,
                         output_size, 1 / 16, sampling_ratio)  # fmt: skip
    assert got.shape == (len(rois), output_size[0] * output_size[1], 6)
    assert float(want.abs().amax()) > 1
    channels_first = got.transpose(1, 2).reshape(want.shape)
    torch.testing.assert_close(channels_first, want, rtol=1e-5, atol=1e-5)

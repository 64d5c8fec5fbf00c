"""RoIAlign as matrix products: what ``torchvision.ops.roi_align`` answers (``aligned=False``),
at the speed of a matrix multiplication.

A region's pooled bin averages bilinear samples on a grid inside the bin. Bilinear weights
and the grid are products of a row part and a column part, and so is the rule that zeroes a
sample outside the map, so a region's pooling is ``rows @ map @ columns``: per image, the map
times every region's column weights in one product, then each region's row weights.
torchvision's and ONNX Runtime's kernels walk every sample of every channel in scalar code
instead (``tests/test_roi_pool.py`` holds these products' answers to torchvision's).

The answer is ``[regions, bins, channels]``: bins before channels, the order in which the
products write it, which the box head's graph takes as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Regions pooled together: their intermediate product, [H, regions x bins_w, C], stays in a
# core's cache (2.5 MB for 32 regions of a 10 x 10 x 256 map).
CHUNK = 32


def roi_align_bins(
    features: torch.Tensor,
    boxes: list[torch.Tensor],
    output_size: tuple[int, int],
    scale: float,
    sampling_ratio: int,
) -> torch.Tensor:
    """``features [N, C, H, W]`` pooled over each image's ``boxes [R_n, 4]`` (x1, y1, x2, y2
    in the input's pixels), as ``roi_align(features, boxes, output_size, scale,
    sampling_ratio, aligned=False)``, arranged ``[sum R_n, bins_h * bins_w, C]``."""
    channels, height, width = features.shape[1:]
    bins_h, bins_w = output_size
    pooled = features.new_empty((sum(len(each) for each in boxes), bins_h * bins_w, channels))
    first = 0
    for image, regions in enumerate(boxes):
        pixels = features[image].permute(1, 2, 0)  # [H, W, C]
        scaled = regions.to(features.dtype) * scale
        rows = axis_weights(scaled[:, 1], scaled[:, 3], bins_h, sampling_ratio, height)
        columns = axis_weights(scaled[:, 0], scaled[:, 2], bins_w, sampling_ratio, width)
        # A few regions at a time, so that what is between the two products stays in cache.
        for part in range(0, len(regions), CHUNK):
            count = min(CHUNK, len(regions) - part)
            # The columns first, for these regions at once: [H, R x bins_w, C] from [H, W, C].
            mine = columns[part : part + count].reshape(count * bins_w, width)
            across = torch.matmul(mine, pixels)
            across = across.reshape(height, count, bins_w * channels).transpose(0, 1)
            # Then each region's rows, in place: [R, bins_h, H] @ [R, H, bins_w x C].
            out = pooled[first : first + count].view(count, bins_h, bins_w * channels)
            torch.bmm(rows[part : part + count], across, out=out)
            first += count
    return pooled


def axis_weights(
    start: torch.Tensor, end: torch.Tensor, bins: int, sampling_ratio: int, length: int
) -> torch.Tensor:
    """Each region's ``bins`` along one axis as weights over the map's ``length`` pixels,
    ``[R, bins, length]``: the mean over the bin's samples of their bilinear weights, with
    torchvision's rules (extent at least 1; samples beyond a pixel outside weigh nothing;
    others clamped to the map)."""
    extent = (end - start).clamp(min=1.0)
    bin_size = extent / bins
    if sampling_ratio > 0:
        grid = torch.full_like(extent, float(sampling_ratio))
    else:  # adaptive, as torchvision: ceil(extent / bins) samples per bin
        grid = torch.ceil(extent / bins)
    most = max(1, int(grid.max())) if len(grid) else 1
    step = torch.arange(most, dtype=start.dtype, device=start.device)
    index = torch.arange(bins, dtype=start.dtype, device=start.device)
    # The same arithmetic, in the same order, as torchvision's sample positions.
    corner = start[:, None, None] + index[None, :, None] * bin_size[:, None, None]
    offset = (step[None, None, :] + 0.5) * bin_size[:, None, None] / grid[:, None, None]
    position = corner + offset  # [R, bins, samples]
    taken = (step[None, None, :] < grid[:, None, None]).to(start.dtype)
    inside = ((position >= -1.0) & (position <= length)).to(start.dtype) * taken
    position = position.clamp(min=0.0)
    low = position.floor()
    edge = low >= length - 1
    low = torch.where(edge, torch.full_like(low, length - 1), low)
    position = torch.where(edge, low, position)
    high = torch.where(edge, low, low + 1)
    fraction = position - low
    weights = start.new_zeros((*position.shape, length))
    weights.scatter_add_(3, low.long()[..., None], ((1 - fraction) * inside)[..., None])
    weights.scatter_add_(3, high.long()[..., None], (fraction * inside)[..., None])
    return weights.sum(2) / grid[:, None, None]


class LevelPooling:
    """``MultiScaleRoIAlign``'s pooling with ``roi_align_bins``: each region pooled from the
    pyramid level its size maps to (``maps``: the levels' indices among the feature maps,
    ``scales`` theirs, ``mapper`` torchvision's ``LevelMapper``), or from the one level when
    every size maps to it. Answers ``[regions, bins, C]`` in the images' order."""

    def __init__(
        self,
        maps: list[int],
        scales: list[float],
        mapper: Callable[[list[torch.Tensor]], torch.Tensor],
        output_size: tuple[int, int],
        sampling_ratio: int,
    ) -> None:
        self.maps, self.scales, self.mapper = maps, scales, mapper
        self.output_size, self.sampling_ratio = output_size, sampling_ratio

    def __call__(self, features: Sequence[torch.Tensor], boxes: list[torch.Tensor]) -> torch.Tensor:
        maps = [features[index] for index in self.maps]
        if len(maps) == 1:
            return roi_align_bins(maps[0], boxes, self.output_size, self.scales[0],
                                  self.sampling_ratio)  # fmt: skip
        level = self.mapper(boxes)
        owner = torch.cat([torch.full((len(each),), image, device=level.device)
                           for image, each in enumerate(boxes)])  # fmt: skip
        channels = maps[0].shape[1]
        bins = self.output_size[0] * self.output_size[1]
        pooled = maps[0].new_zeros((len(level), bins, channels))
        for index, (each, scale) in enumerate(zip(maps, self.scales, strict=True)):
            chosen = level == index
            if not bool(chosen.any()):
                continue
            # Image-major, as the regions are: the chosen ones of each image in turn.
            mine = [regions[chosen[owner == image]] for image, regions in enumerate(boxes)]
            pooled[chosen] = roi_align_bins(each, mine, self.output_size, scale,
                                            self.sampling_ratio)  # fmt: skip
        return pooled

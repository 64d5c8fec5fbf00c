"""How closely one detector's boxes follow another's, image by image: what the start-up check
of an exported detector and the INT8 gate of a detector judge by.

A detection of the reference is *found* when the candidate has a box of the same label that
overlaps it at IoU >= 0.5 (each candidate box matched once, the reference's best boxes first,
each to its most overlapping box). Only boxes scoring at least ``min_score`` are judged
(``0``: every box served), and either side's boxes are matched against the other's scoring
at least half of that: a box fp32 scores 0.52 and INT8 0.48 is the same answer, not a miss.

- ``box_recall``: the share of the reference's judged boxes the candidate finds;
- ``box_precision``: the share of the candidate's judged boxes the reference finds;
- ``matched_iou``: the mean IoU of the reference's judged boxes with the boxes that found
  them (how far the found boxes moved);
- ``reference_boxes`` and ``candidate_boxes``: how many were judged; too few reference boxes
  and there is nothing to judge by;
- ``tied_boxes``: boxes not judged, missed by the other side where they tie with the last
  box it served (within ``tie``): which of equal scores make the last places is rounding;
- an instance segmenter's ``mask_iou``: the mean IoU of the masks of the reference's judged
  boxes with the masks of the boxes that found them; a keypoint detector's
  ``keypoint_distance``: the mean distance in pixels of their keypoints, and
  ``keypoint_pck``: the share of those keypoints within a tenth of the reference box's longer
  side of the reference's (PCK@0.1, a floor that does not depend on the image's size), or
  within a pixel (a box of a few pixels would ask for agreement finer than rounding). Where
  the reference answers masks or keypoints and the candidate does not, its matches score 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from app.engine.tasks.answers import Detected

MATCH_IOU = 0.5
# The figures of a detector that answers masks or keypoints: absent for one that does not.
INSTANCE_FIGURES = ("mask_iou", "keypoint_pck")
# A keypoint agrees within this share of its box's longer side (PCK@0.1), or this many pixels.
PCK_ALPHA = 0.1
PCK_PIXELS = 1.0


def compare_detections(
    reference: Sequence[Detected],
    candidate: Sequence[Detected],
    min_score: float = 0.0,
    tie: float = 0.0,
) -> dict[str, Any]:
    """The figures above, pooled over every image. A box one side misses is not held against
    it when its score ties, within ``tie``, with the lowest score that side served (its cut):
    which of near-equal boxes make the last places is rounding (a model with random weights
    scores every anchor alike). A missed box that scores below the cut by more than that is a
    miss: a side that answers only its best few boxes loses the others."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference answers against {len(candidate)}")
    recall, precision = _Tally(), _Tally()
    for ref, cand in zip(reference, candidate, strict=True):
        recall.add(ref, cand, min_score, tie)
        precision.add(cand, ref, min_score, tie)
    instances: dict[str, Any] = {}
    if recall.mask_ious:
        instances["mask_iou"] = float(np.mean(recall.mask_ious))
    if recall.distances:
        instances["keypoint_distance"] = float(np.mean(recall.distances))
    if recall.within:
        instances["keypoint_pck"] = float(np.mean(recall.within))
    return instances | {
        "images": len(reference),
        "judged_from_score": min_score,
        "reference_boxes": recall.judged,
        "candidate_boxes": precision.judged,
        "tied_boxes": recall.tied + precision.tied,
        "box_recall": recall.share,
        "box_precision": precision.share,
        "matched_iou": float(np.mean(recall.ious)) if recall.ious else None,
        "max_score_difference": max(recall.score_differences, default=0.0),
    }


class _Tally:
    """How many of one side's judged boxes the other side finds."""

    def __init__(self) -> None:
        self.judged = self.found = self.tied = 0
        self.ious: list[float] = []
        self.score_differences: list[float] = []
        self.mask_ious: list[float] = []
        self.distances: list[float] = []
        self.within: list[float] = []

    def add(self, ours: Detected, theirs: Detected, min_score: float, tie: float) -> None:
        judged = np.flatnonzero(ours.scores >= min_score)
        pairs = _matches(ours, theirs, judged, lenient=min_score / 2)
        found = {r for r, _, _ in pairs}
        last = float(theirs.scores.min()) if len(theirs) else -np.inf
        tied = (
            sum(1 for r in judged if r not in found and abs(ours.scores[r] - last) <= tie)
            if tie
            else 0
        )
        self.judged += len(judged) - tied
        self.tied += tied
        self.found += len(pairs)
        self.ious += [iou for _, _, iou in pairs]
        self.score_differences += [abs(float(ours.scores[r] - theirs.scores[c]))
                                   for r, c, _ in pairs]  # fmt: skip
        if ours.masks is not None and pairs:
            self.mask_ious += _mask_ious(ours.masks, theirs.masks, pairs)
        if ours.keypoints is not None:
            for r, c, _ in pairs:
                if theirs.keypoints is None:  # no distance to give: none of them agrees
                    self.within.append(0.0)
                    continue
                apart = ours.keypoints[r, :, :2] - theirs.keypoints[c, :, :2]
                distances = np.linalg.norm(apart, axis=1)
                x1, y1, x2, y2 = ours.boxes[r]
                self.distances.append(float(distances.mean()))
                near = max(PCK_ALPHA * max(x2 - x1, y2 - y1), PCK_PIXELS)
                self.within.append(float(np.mean(distances <= near)))

    @property
    def share(self) -> float | None:
        return min(1.0, self.found / self.judged) if self.judged else None


def _mask_ious(
    ours: Sequence[dict[str, Any]],
    theirs: Sequence[dict[str, Any]] | None,
    pairs: list[tuple[int, int, float]],
) -> list[float]:
    """The IoU of each pair's two masks (0 where the other side answers none)."""
    if theirs is None:
        return [0.0] * len(pairs)
    from pycocotools import mask as coco

    ious = coco.iou([_rle(ours[r]) for r, _, _ in pairs],
                    [_rle(theirs[c]) for _, c, _ in pairs],
                    [0] * len(pairs))  # fmt: skip
    return [float(ious[index, index]) for index in range(len(pairs))]


def _rle(mask: dict[str, Any]) -> dict[str, Any]:
    """A run-length mask as pycocotools reads it (its counts as bytes)."""
    return {"size": mask["size"], "counts": mask["counts"].encode("ascii")}


def _matches(
    ref: Detected, cand: Detected, judged: np.ndarray[Any, Any], lenient: float
) -> list[tuple[int, int, float]]:
    """``(reference index, candidate index, IoU)`` of each judged reference box found, the
    best first. Pairs are taken by IoU, the closest first, not by score: two answers of one
    model hold the same boxes, and where scores tie (a saturated sigmoid answers many boxes
    1.0) a box whose twin the other side left out must not take another box's twin."""
    usable = np.flatnonzero(cand.scores >= lenient)
    pairs: list[tuple[float, int, int]] = []
    for r in judged:
        same = usable[cand.labels[usable] == ref.labels[r]]
        if len(same):
            overlaps = box_iou(ref.boxes[r], cand.boxes[same])
            near = overlaps >= MATCH_IOU
            pairs += [(float(iou), int(r), int(c))
                      for iou, c in zip(overlaps[near], same[near], strict=True)]  # fmt: skip
    taken_ref: set[int] = set()
    taken_cand: set[int] = set()
    found = []
    for iou, r, c in sorted(pairs, key=lambda pair: (-pair[0], -ref.scores[pair[1]], pair[1])):
        if r not in taken_ref and c not in taken_cand:
            taken_ref.add(r)
            taken_cand.add(c)
            found.append((r, c, iou))
    return sorted(found, key=lambda pair: (-ref.scores[pair[0]], pair[0]))


def box_iou(box: np.ndarray[Any, Any], boxes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """IoU of one ``x1, y1, x2, y2`` box with each of ``boxes [k, 4]``. Two boxes without area
    (clipping flattens a box past the image's edge) have none to share: they match, IoU 1,
    where their corners are within half a pixel of each other."""
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = area + areas - inter
    iou: np.ndarray[Any, Any] = np.divide(
        inter, union, out=np.zeros_like(inter, dtype=np.float64), where=union > 0
    )
    flat = union <= 0
    if flat.any():
        iou[flat] = (np.abs(boxes[flat] - box).max(axis=1) <= 0.5).astype(np.float64)
    return iou

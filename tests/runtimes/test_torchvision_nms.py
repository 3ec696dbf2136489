"""The plain-torch stand-in for torchvision's NMS keeps the boxes a straightforward loop
over pairwise IoU keeps (as torchvision's C++ kernel, in float32), on fresh random boxes
with many equal scores, duplicate and empty boxes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.runtimes.torchvision_nms import nms


def reference_nms(boxes: np.ndarray, scores: np.ndarray, threshold: float) -> list[int]:
    """Highest score first (of equal scores, the lower index); drop every later box whose
    IoU with a kept one is above the threshold; arithmetic in the boxes' own dtype."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # a stable sort
    zero = boxes.dtype.type(0)
    kept: list[int] = []
    dropped: set[int] = set()
    with np.errstate(invalid="ignore", divide="ignore"):
        for at, i in enumerate(order):
            if i in dropped:
                continue
            kept.append(i)
            x1, y1, x2, y2 = boxes[i]
            area_i = (x2 - x1) * (y2 - y1)
            for j in order[at + 1 :]:
                w = max(zero, min(x2, boxes[j, 2]) - max(x1, boxes[j, 0]))
                h = max(zero, min(y2, boxes[j, 3]) - max(y1, boxes[j, 1]))
                inter = w * h
                area_j = (boxes[j, 2] - boxes[j, 0]) * (boxes[j, 3] - boxes[j, 1])
                if float(inter / (area_i + area_j - inter)) > threshold:
                    dropped.add(j)
    return kept


def random_boxes(rng: np.random.Generator, n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """n boxes in a small field (so many overlap), some repeated and some of no area;
    scores from five values, so many are equal."""
    corner = rng.uniform(0, 40, (n, 2))
    sides = rng.uniform(0, 20, (n, 2)) * (rng.random((n, 1)) > 0.05)  # some of no area
    boxes = np.concatenate([corner, corner + sides], axis=1)
    repeats = rng.random(n) < 0.1
    boxes[repeats] = boxes[rng.integers(0, n, repeats.sum())]
    scores = rng.integers(0, 5, n) / 4
    return boxes.astype(dtype), scores.astype(dtype)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_keeps_what_a_loop_over_iou_keeps(threshold, dtype):
    rng = np.random.default_rng()  # fresh boxes each run; the seed is in the failure
    seed = int(rng.integers(1 << 32))
    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 60, 300):
        boxes, scores = random_boxes(rng, n, dtype)
        got = nms(torch.from_numpy(boxes), torch.from_numpy(scores), threshold)
        assert got.dtype == torch.long
        assert got.tolist() == reference_nms(boxes, scores, threshold), f"seed {seed}, n {n}"


def test_of_equal_scores_the_lower_index_is_kept():
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [1, 1, 10, 10], [50, 50, 60, 60]])
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5])
    assert nms(boxes, scores, 0.5).tolist() == [0, 3]
    assert nms(boxes, torch.tensor([0.5, 0.9, 0.5, 0.1]), 0.5).tolist() == [1, 3]


def test_no_boxes_keep_none():
    kept = nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert kept.shape == (0,) and kept.dtype == torch.long


def test_boxes_of_the_wrong_shape_are_refused():
    with pytest.raises(RuntimeError, match="4 elements"):
        nms(torch.zeros(3, 5), torch.zeros(3), 0.5)
    with pytest.raises(RuntimeError, match="3 boxes and 2 scores"):
        nms(torch.zeros(3, 4), torch.zeros(2), 0.5)

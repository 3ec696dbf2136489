"""torchvision's non-maximum suppression in plain torch, where its compiled ops do not load.

PyPI's torchvision for Linux x86-64 is built against the CUDA build of torch. Beside a
CPU-only torch its `_C` library does not load; `import torchvision` then fails (it
registers a fake kernel for `torchvision::nms`, an operator only `_C` defines) and
`torchvision.ops.nms` refuses to run. `install_nms()` defines that operator (and `qnms`,
which the import also expects) with the kernel below, and lets `torchvision.ops.boxes`
call it, so code that takes its NMS from torchvision (facenet-pytorch's MTCNN) runs
unchanged. Where `_C` loads (a GPU host, a torchvision built for this torch), nothing is
replaced.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util

import torch

NMS_SCHEMA = "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
QNMS_SCHEMA = "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"

_library: torch.library.Library | None = None  # kept: its registrations live as long as it


def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """The indices of the boxes kept, highest score first, as torchvision's CPU kernel
    keeps them: a box goes when its IoU with a kept, higher-scoring box is above
    `iou_threshold` (compared in float64, as there); of equal scores, the lower index
    comes first."""
    _check_boxes(dets, scores)
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    boxes = dets[order]
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep = []
    left = torch.arange(len(order), device=dets.device)  # positions in `order` not yet dropped
    while left.numel() > 0:
        first, rest = left[0], left[1:]
        keep.append(first)
        overlap = _iou(boxes[first], areas[first], boxes[rest], areas[rest])
        left = rest[~(overlap.double() > iou_threshold)]
    return order[torch.stack(keep)]


def _iou(box: torch.Tensor, area: torch.Tensor, boxes: torch.Tensor, areas: torch.Tensor):
    """One box's IoU with each of `boxes`, in the operations (and rounding) of the C++."""
    low = torch.maximum(box[:2], boxes[:, :2])
    high = torch.minimum(box[2:], boxes[:, 2:])
    sides = (high - low).clamp(min=0)
    inter = sides[:, 0] * sides[:, 1]
    return inter / (area + areas - inter)


def _check_boxes(dets: torch.Tensor, scores: torch.Tensor) -> None:
    torch._check(dets.dim() == 2, lambda: f"boxes should be a 2d tensor, got {dets.dim()}D")
    torch._check(dets.size(1) == 4, lambda: f"boxes should have 4 elements, got {dets.size(1)}")
    torch._check(scores.dim() == 1, lambda: f"scores should be a 1d tensor, got {scores.dim()}")
    torch._check(
        dets.size(0) == scores.size(0),
        lambda: f"{dets.size(0)} boxes and {scores.size(0)} scores",
    )
    torch._check(
        dets.is_floating_point() and dets.dtype == scores.dtype,
        lambda: f"boxes ({dets.dtype}) and scores ({scores.dtype}) of one floating type",
    )


def compiled_ops_load() -> bool:
    """Whether torchvision's `_C` loads beside this torch (found as torchvision finds it)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    loader = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    for location in spec.submodule_search_locations:
        found = importlib.machinery.FileFinder(location, loader).find_spec("_C")
        if found is not None and found.origin:
            try:
                torch.ops.load_library(found.origin)
            except OSError:
                return False
            return True
    return False


def install_nms() -> bool:
    """Before torchvision is imported: define `torchvision::nms` with the kernel above
    unless torchvision's own loads. True where the stand-in is in use."""
    global _library
    if _library is not None:
        return True
    if importlib.util.find_spec("torchvision") is None or compiled_ops_load():
        return False
    library = torch.library.Library("torchvision", "FRAGMENT")
    library.define(NMS_SCHEMA)
    library.define(QNMS_SCHEMA)  # declared only: quantized boxes find no kernel
    for device in ("CPU", "CUDA"):
        library.impl("nms", nms, device)
    _library = library
    boxes = importlib.import_module("torchvision.ops.boxes")
    boxes._assert_has_ops = _nms_defined  # it asks whether all of `_C` loaded
    return True


def _nms_defined() -> None:
    """torchvision.ops.boxes' check before it calls `torchvision::nms`: defined here."""

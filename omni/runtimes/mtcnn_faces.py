"""Face detection with MTCNN and the weights the `facenet-pytorch` package ships.

Input `image`: one PNG or JPEG file (BYTES [1]). Outputs `boxes`: each face as
[x1, y1, x2, y2] in pixels (FP32 [n, 4]), and `probs`: each face's probability (FP32 [n]),
both empty where there is no face. Images of a batch differ in size, so each is detected
alone, as `MTCNN.detect` would be called on it bare; a file that is not an image fails
its own request alone.

Dependencies: facenet-pytorch pins old torch, numpy and Pillow releases it does not need
for detection; it is installed with `--no-deps` into the model's own environment, beside
the torchvision released with the torch that runs it (MTCNN takes its non-maximum
suppression from torchvision's compiled ops). PyPI's torchvision for Linux x86-64 is built
against the CUDA build of torch: beside a CPU-only torch its ops do not load, and
torchvision_nms.py stands in for the one MTCNN needs, before facenet_pytorch is imported.

Weights: `weights = "package"` in omni-model.toml takes the P-, R- and O-net weights in
the wheel; otherwise the model directory holds `pnet.pt`, `rnet.pt` and `onet.pt` (state
dicts, as in the wheel). Optional keys: `min_face_size` (pixels, default 20),
`thresholds` (the three stages', default [0.6, 0.7, 0.7]).
"""

from __future__ import annotations

import importlib
import io
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from omni.instance.handler import Answers, Handler, HandlerError, TensorSpec, each

from .model_config import read_model_config, weights_from_package
from .tensors import single_bytes
from .torchvision_nms import install_nms

NETS = ("pnet", "rnet", "onet")

install_nms()  # torchvision's own NMS where it loads, else the stand-in
MTCNN = importlib.import_module("facenet_pytorch").MTCNN


def build_detector(model_dir: Path, device: str) -> MTCNN:
    config = read_model_config(model_dir)
    detector = MTCNN(
        keep_all=True,
        min_face_size=int(config.get("min_face_size", 20)),
        thresholds=[float(t) for t in config.get("thresholds", (0.6, 0.7, 0.7))],
        device=torch.device(device),
    )
    if not weights_from_package(model_dir):
        for net in NETS:
            state = torch.load(Path(model_dir) / f"{net}.pt", map_location=device)
            getattr(detector, net).load_state_dict(state)
    return detector.eval()


def read_image(request: dict[str, np.ndarray]) -> Image.Image:
    return decode_image(single_bytes(request, "image"))


def decode_image(data: bytes) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise HandlerError(f"image: not a PNG or JPEG file Pillow can read ({e})") from e


def detect_faces(detector: MTCNN, image: Image.Image) -> dict[str, np.ndarray]:
    boxes, probs = detector.detect(image)
    if boxes is None:  # MTCNN's answer for no face
        return {"boxes": np.zeros((0, 4), np.float32), "probs": np.zeros(0, np.float32)}
    return {"boxes": boxes.astype(np.float32), "probs": probs.astype(np.float32)}


class MTCNNFaces(Handler):
    inputs = (TensorSpec("image", "BYTES", (1,)),)
    outputs = (TensorSpec("boxes", "FP32", (-1, 4)), TensorSpec("probs", "FP32", (-1,)))
    max_batch_size = 4  # detected one by one; batching only saves the queue's round trips

    def load(self, model_dir: Path, device: str) -> None:
        self.detector = build_detector(model_dir, device)

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        images = each(batch, read_image)
        with torch.inference_mode():
            return each(images, partial(detect_faces, self.detector))

    def unload(self) -> None:
        self.detector = None

"""Working memory of the catalog's heaviest handlers, by setting: the most a batch holds
over the loaded weights, as served (the handler classes themselves, on the catalog's
realistic shapes with random weights, bench/catalog_models.py).

Cases: text to image (SD-1.5 shape, 256x256, 4 steps, guidance 7.5) at batch 4 with the
VAE decoding together or one image at a time (`vae_slicing`); the detector (DETR-ResNet-50,
640x480 images, 800x1066 after the processor) at batch 8 in float32 and, on a GPU, float16
(`gpu_dtype`). On a GPU the figure is torch's peak allocation; on the CPU, the process's
peak resident memory (sampled every 5 ms). Writes bench/results/handler-memory-<device>.json.

    python bench/diagnostics/handler_memory.py [--kinds t2i detector]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.catalog_bench import picture
from bench.catalog_models import write_detr, write_sd
from bench.engine_bench import device_tag
from bench.results_io import write_result
from omni.runtimes.model_config import CONFIG_NAME
from omni.runtimes.object_detector import ObjectDetector
from omni.runtimes.text_to_image import TextToImage

MIB = 1 << 20


def peak_over(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """(MiB held at the peak of `fn` over what was held before, seconds it took)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.monotonic()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB, time.monotonic() - t0
    me, stop = psutil.Process(), threading.Event()
    base = me.memory_info().rss
    peak = [base]

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    fn()
    took = time.monotonic() - t0
    stop.set()
    watcher.join()
    return (peak[0] - base) / MIB, took


def measured(handler_class, model_dir: Path, settings: str, batch: list, device: str) -> dict:
    """One case: the handler loaded with `settings` (its omni-model.toml), warmed on one
    request, then `batch` served whole; its peak over the loaded weights and its time."""
    (model_dir / CONFIG_NAME).write_text(settings)
    handler = handler_class()
    handler.load(model_dir, device)
    handler.infer(batch[:1])  # warm
    mib, took = peak_over(lambda: handler.infer(batch), device)
    handler.unload()
    return {"batch": len(batch), "peak_over_weights_mib": round(mib), "seconds": round(took, 2)}


def text(value: str) -> np.ndarray:
    out = np.empty(1, dtype=object)
    out[0] = value.encode()
    return out


def t2i_cases(root: Path, device: str) -> list[dict]:
    model_dir = write_sd(root / "t2i", tiny=False)
    batch = [
        {
            "prompt": text(f"a red fox in the snow, picture {i}"),
            "width": np.array([256], np.int32),
            "height": np.array([256], np.int32),
            "seed": np.array([i], np.int64),
        }
        for i in range(4)
    ]
    rows = []
    for slicing in (False, True):
        settings = f"steps = 4\nguidance = 7.5\nvae_slicing = {str(slicing).lower()}\n"
        row = measured(TextToImage, model_dir, settings, batch, device)
        rows.append({"kind": "t2i", "setting": f"vae_slicing={slicing}"} | row)
    return rows


def detector_cases(root: Path, device: str) -> list[dict]:
    model_dir = write_detr(root / "detector", tiny=False)
    batch = []
    for i in range(8):
        image = np.empty(1, dtype=object)
        image[0] = picture(640, 480, i)
        batch.append({"image": image})
    rows = []
    for dtype in ("float32", "float16") if device == "cuda" else ("float32",):
        row = measured(ObjectDetector, model_dir, f'gpu_dtype = "{dtype}"\n', batch, device)
        rows.append({"kind": "detector", "setting": f"gpu_dtype={dtype}"} | row)
    return rows


CASES = {"t2i": t2i_cases, "detector": detector_cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", choices=list(CASES), default=list(CASES))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="handler-memory-") as tmp:
        for kind in args.kinds:
            rows += CASES[kind](Path(tmp), device)
    print(f"{'kind':9} {'batch':>5}  {'setting':22} {'peak over weights':>18} {'seconds':>8}")
    for r in rows:
        print(
            f"{r['kind']:9} {r['batch']:5}  {r['setting']:22} "
            f"{r['peak_over_weights_mib']:14} MiB {r['seconds']:8.2f}"
        )
    name = f"handler-memory-{device_tag()}"
    measure = "torch peak allocation" if device == "cuda" else "peak RSS, sampled every 5 ms"
    print("wrote", write_result(name, {"measure": measure, "cases": rows}))


if __name__ == "__main__":
    main()

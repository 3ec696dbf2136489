"""A sandboxed instance uses the GPU it is given, and sees no other (device machine only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni.isolation.sandbox import Limits

from .test_escape import run

pytestmark = pytest.mark.gpu

GPU_NODE = re.compile(r"^nvidia(\d+)$")

CUDA_PROGRAM = """
import torch
ok = torch.cuda.is_available()
result = {}
if ok:
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    ref = a.cpu() @ b.cpu()
    result["max_err"] = (a @ b).cpu().sub(ref).abs().max().item()
    result["name"] = torch.cuda.get_device_name(0)
gpus = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
"""
LIMITS = Limits(memory_bytes=16 << 30, pids=256)


def host_gpus() -> list[int]:
    return sorted(int(m.group(1)) for p in Path("/dev").iterdir() if (m := GPU_NODE.match(p.name)))


def test_gpu_instance_computes_on_its_gpu(host):
    given = host_gpus()[0]
    others = [g for g in host_gpus() if g != given]
    r = run(
        host,
        CUDA_PROGRAM
        + f"""
others = [attempt(lambda i=i: os.open(f"/dev/nvidia{{i}}", os.O_RDWR)) for i in {others}]
report(cuda=ok, gpus=gpus, others=others, **result)
""",
        gpus=(given,),
        limits=LIMITS,
    )
    assert r["cuda"] is True, r
    assert r["max_err"] < 1e-2  # TF32 tolerance against the CPU product
    numbered = [n for n in r["gpus"] if GPU_NODE.match(n)]
    assert numbered == [f"nvidia{given}"]  # only its own GPU's node is there
    assert r["others"] == ["ENOENT"] * len(others)


def test_cpu_instance_gets_no_gpu(host):
    r = run(
        host,
        CUDA_PROGRAM
        + """
report(cuda=ok, gpus=gpus, open0=attempt(lambda: os.open("/dev/nvidia0", os.O_RDWR)),
       ctl=attempt(lambda: os.open("/dev/nvidiactl", os.O_RDWR)))
""",
        limits=LIMITS,
    )
    assert r == {"cuda": False, "gpus": [], "open0": "ENOENT", "ctl": "ENOENT"}

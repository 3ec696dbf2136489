"""A sandboxed instance uses the GPU it is given, and sees no other (device machine only)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from omni.isolation.sandbox import Limits
from omni.testing.checkpoints import tiny_llama
from tests.nodes import Omnid

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
def sysctl():
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
report(cuda=ok, gpus=gpus, others=others, sysctl=attempt(sysctl),
       memfd_noexec=open("/proc/sys/vm/memfd_noexec").read().strip(), **result)
""",
        gpus=(given,),
        limits=LIMITS,
    )
    assert r["cuda"] is True, r
    assert r["max_err"] < 1e-2  # TF32 tolerance against the CPU product
    numbered = [n for n in r["gpus"] if GPU_NODE.match(n)]
    assert numbered == [f"nvidia{given}"]  # only its own GPU's node is there
    assert r["others"] == ["ENOENT"] * len(others)
    # its /proc is writable (the driver's cuInit needs it), the kernel's knobs are not
    assert r["sysctl"] == "EROFS"
    assert r["memfd_noexec"] == "2"


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


def test_a_gpu_instance_under_omnid_serves_and_swaps_through_its_sealed_block(tmp_path):
    """The real shim under real CUDA, in omnid's sandbox: its control block is a sealed
    memfd the sandbox's init holds (/proc/1/fd/N), none sits in the instance's directory,
    and omnid's swaps move its memory through it; after omnid is killed, the next one
    adopts the instance and its block."""
    model = tiny_llama(Path(tempfile.mkdtemp(prefix="omni-gpu-", dir="/tmp")) / "m")
    for path in (model.parent, model, *model.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    gpu = host_gpus()[0]
    config = (
        f'[[gpus]]\nindex = {gpu}\nbudget = "2GiB"\n'
        f'[[models]]\nname = "g"\npath = "{model}"\ngpu = {gpu}\nquota = "1GiB"\n'
    )
    node = Omnid(tmp_path, config, "--sandbox", "isolated")
    body = {"model": "g", "prompt": "t1 t2 t3", "max_tokens": 4, "temperature": 0}
    try:
        node.wait_ready(["g"], timeout_s=300)
        first = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert sorted(os.listdir(node.runtime_dir / "instances" / "g")) == ["gpu.yield", "io"]
        with node.admin() as c:
            out = c.post("/v1/instances/g/swap-out")
            assert out.status_code == 200 and out.json()["residency"] == "swapped", out.text
            assert node.instances()["g"]["used_bytes"] > 0  # the shim counts, through it
        again = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        before = node.instances()["g"]
        assert before["residency"] == "resident"

        node.proc.kill()  # a crash: the next omnid adopts the instance on its GPU
        node.proc.wait()
        node = Omnid(tmp_path, config, "--sandbox", "isolated", runtime_dir=node.runtime_dir)
        node.wait_ready(["g"], timeout_s=120)
        adopted = node.instances()["g"]
        assert (adopted["pid"], adopted["residency"]) == (before["pid"], "resident")
        assert adopted["used_bytes"] == before["used_bytes"] > 0
        after = httpx.post(f"{node.base_url}/v1/completions", json=body, timeout=120)
        assert after.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        with node.admin() as c:  # its memory still moves through the reopened block
            out = c.post("/v1/instances/g/swap-out")
            assert out.status_code == 200 and out.json()["residency"] == "swapped", out.text
    finally:
        assert node.stop() == 0
        shutil.rmtree(model.parent, ignore_errors=True)

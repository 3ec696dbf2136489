"""libomnicuda against a fake CUDA: quota, accounting, interception routes, swap."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys

from omni.cudashim import Mode, ShimResidency, swap_in, swap_out
from omni.cudashim.control import ControlStruct

from .conftest import kv

MiB = 1 << 20

# A Python program under the shim: it loads the runtime with ctypes (dlopen +
# dlsym, as frameworks do), allocates, reports its pointers, and waits.
ALLOCATE_AND_WAIT = """
import ctypes, sys
rt = ctypes.CDLL("libcudart.so.13")
sizes = [int(s) for s in sys.argv[1:]] if len(sys.argv) > 1 else {sizes}
ptrs = []
for size in sizes:
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size)) == 0
    ptrs.append(p.value)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
print(" ".join(hex(p) for p in ptrs), free.value, total.value, flush=True)
sys.stdin.readline()
"""


def test_control_block_layout_matches_the_header(tmp_path):
    fields = [name for name, _ in ControlStruct._fields_]
    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "omnicuda.h"\nint main(void){\n'
        + 'printf("size %zu\\n", sizeof(struct omni_control));\n'
        + "".join(f'printf("{f} %zu\\n", offsetof(struct omni_control, {f}));\n' for f in fields)
        + "return 0;}\n"
    )
    from omni.cudashim.build import SOURCE_DIR

    subprocess.run(["cc", f"-I{SOURCE_DIR}", "-o", str(tmp_path / "layout"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True).stdout
    c_layout = dict(line.split() for line in out.splitlines())
    assert int(c_layout["size"]) == ctypes.sizeof(ControlStruct)
    for name in fields:
        assert int(c_layout[name]) == getattr(ControlStruct, name).offset, name


def test_quota_is_enforced_at_the_exact_byte(fake, tmp_path):
    quota = 10 * MiB + 7
    result, block, _ = fake.run(
        tmp_path, [str(fake.probe), "boundary", str(quota)], quota, Mode.PASSTHROUGH
    )
    assert result.returncode == 0, result.stderr
    r = kv(result.stdout)
    assert (r["exact"], r["one_more"], r["over"]) == (0, 2, 2)  # 2: out of memory
    assert (r["most"], r["last_byte"], r["past"]) == (0, 0, 2)
    assert (r["free"], r["total"]) == (0, quota)  # cudaMemGetInfo rewritten
    assert r["free_after"] == quota
    stats = block.stats()
    assert stats["alloc_failures"] == 3
    assert stats["used_bytes"] == 0 and stats["live_allocs"] == 0
    assert stats["peak_bytes"] == quota


def test_accounting_is_exact_under_8_threads(fake, tmp_path):
    result, block, _ = fake.run(tmp_path, [str(fake.probe), "threads"], 1 << 40, Mode.PASSTHROUGH)
    assert result.returncode == 0, result.stderr
    r = kv(result.stdout)
    assert r["expected"] > 0
    assert r["reported"] == r["expected"]
    assert block.stats()["used_bytes"] == r["expected"]


def test_dlsym_and_get_proc_address_routes_are_hooked(fake, tmp_path):
    n = 3 * MiB
    result, block, log = fake.run(
        tmp_path, [str(fake.probe), "routes", str(n)], 100 * MiB, Mode.PASSTHROUGH
    )
    assert result.returncode == 0, result.stderr
    r = kv(result.stdout)
    assert (r["dlsym_runtime"], r["dlsym_driver"], r["proc_address"]) == (0, 0, 0)
    assert r["driver_used"] == 3 * n and r["driver_total"] == 100 * MiB
    assert block.stats()["used_bytes"] == 3 * n
    # the runtime reached the driver through cuGetProcAddress and was counted once
    assert log.read_text().count("cuMemAlloc_v2") == 3


def test_managed_mode_allocates_unified_memory_on_the_gpu(fake, tmp_path):
    result, _, log = fake.run(
        tmp_path, [str(fake.probe), "routes", str(MiB)], 100 * MiB, Mode.MANAGED
    )
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    assert sum(line.startswith("cuMemAllocManaged") for line in lines) == 3
    assert not any(line.startswith("cuMemAlloc_v2") for line in lines)
    assert sum(line.startswith("advise") and line.endswith("3 device") for line in lines) == 3


def test_swap_out_and_in_prefetch_every_live_allocation(fake, tmp_path):
    sizes = [MiB, 3 * MiB, 17, 5 * MiB]
    proc, block, log = fake.spawn(
        tmp_path, ALLOCATE_AND_WAIT.format(sizes=sizes), 64 * MiB, Mode.MANAGED
    )
    try:
        ptrs, free, total = proc.stdout.readline().rsplit(" ", 2)
        ptrs = ptrs.split()
        assert (int(free), int(total)) == (64 * MiB - sum(sizes), 64 * MiB)
        out = swap_out(block, timeout_s=10)
        assert out.bytes == sum(sizes) and block.residency == ShimResidency.HOST
        moved_out = re.findall(r"^prefetch (\S+) (\d+) host$", log.read_text(), re.M)
        assert sorted(moved_out) == sorted(zip(ptrs, map(str, sizes), strict=True))
        back = swap_in(block, timeout_s=10)
        assert back.bytes == sum(sizes) and block.residency == ShimResidency.GPU
        moved_in = re.findall(r"^prefetch (\S+) (\d+) device$", log.read_text(), re.M)
        assert sorted(moved_in) == sorted(moved_out)
        text = log.read_text()
        assert text.count("cuStreamSynchronize") >= 2  # each move waited for its copies
        assert block._ctl.ack_seq == 2 and block._ctl.last_swap_error == 0
    finally:
        proc.communicate("done\n", timeout=10)
    assert proc.returncode == 0, proc.stderr


def test_swap_only_moves_what_is_still_allocated(fake, tmp_path):
    code = ALLOCATE_AND_WAIT.format(sizes=[MiB, 2 * MiB]).replace(
        "print(", "rt.cudaFree(ctypes.c_void_p(ptrs[0]))\nprint("
    )
    proc, block, log = fake.spawn(tmp_path, code, 0, Mode.MANAGED)
    try:
        ptrs = proc.stdout.readline().split()[:2]
        assert swap_out(block, timeout_s=10).bytes == 2 * MiB
        moved = re.findall(r"^prefetch (\S+) ", log.read_text(), re.M)
        assert moved == [ptrs[1]]
    finally:
        proc.communicate("done\n", timeout=10)


def test_vmm_is_refused_in_managed_mode_and_counted_otherwise(fake, tmp_path):
    code = """
import ctypes
drv = ctypes.CDLL("libcuda.so.1")
h = ctypes.c_ulonglong()
print(drv.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(1 << 20), None, ctypes.c_ulonglong(0)))
"""
    managed, block, _ = fake.run(tmp_path, [sys.executable, "-c", code], 0, Mode.MANAGED)
    assert managed.stdout.strip() == "801"  # CUDA_ERROR_NOT_SUPPORTED
    assert "cuMemCreate (virtual memory management) is refused" in managed.stderr
    passthrough, block, _ = fake.run(tmp_path, [sys.executable, "-c", code], 0, Mode.PASSTHROUGH)
    assert passthrough.stdout.strip() == "0"
    assert block.stats()["used_bytes"] == 1 << 20


def test_harmless_in_a_process_without_cuda(fake, tmp_path):
    for argv in (["/bin/true"], [sys.executable, "-c", "import json; print(json.dumps(1))"]):
        result, block, _ = fake.run(tmp_path, argv, MiB, Mode.MANAGED)
        assert result.returncode == 0 and result.stderr == ""
        assert block.stats()["used_bytes"] == 0


def test_fork_child_does_not_touch_the_parents_accounting(fake, tmp_path):
    code = """
import ctypes, os
rt = ctypes.CDLL("libcudart.so.13")
p = ctypes.c_void_p()
rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1000))
pid = os.fork()
if pid == 0:
    q = ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(q), ctypes.c_size_t(5000))
    os._exit(0)
os.waitpid(pid, 0)
"""
    result, block, _ = fake.run(tmp_path, [sys.executable, "-c", code], 0, Mode.PASSTHROUGH)
    assert result.returncode == 0, result.stderr
    assert block.stats()["used_bytes"] == 1000


def test_a_driver_that_hands_out_the_shims_own_functions_does_not_loop(fake, tmp_path):
    loose = fake.libdir / "loose"
    result, block, _ = fake.run(
        tmp_path,
        [str(fake.probe), "routes", str(MiB)],
        100 * MiB,
        Mode.PASSTHROUGH,
        libdir=loose,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    assert kv(result.stdout)["driver_used"] == 3 * MiB
    assert block.stats()["used_bytes"] == 3 * MiB

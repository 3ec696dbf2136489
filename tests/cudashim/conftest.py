"""Build the fake CUDA (driver + runtime), the probe, and the shim; run programs under it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from omni.cudashim import ControlBlock, Mode, instance_env, library_path

HERE = Path(__file__).resolve().parent


def cc(*args: str) -> None:
    subprocess.run(["cc", "-Wall", "-O1", *args], check=True, capture_output=True, text=True)


@dataclass
class Fake:
    libdir: Path
    probe: Path
    shim: Path

    def _under_shim(self, tmp: Path, quota: int, mode: Mode, libdir: Path | None = None):
        """A fresh control block and call log, and the environment that uses them."""
        (tmp / "control").unlink(missing_ok=True)  # a block is created afresh, never reused
        block = ControlBlock.create(tmp / "control", quota, mode)
        log = tmp / "cuda.log"
        log.unlink(missing_ok=True)
        env = {
            **os.environ,
            **instance_env(block.path, self.shim),
            "LD_LIBRARY_PATH": str(libdir or self.libdir),
            "FAKE_CUDA_LOG": str(log),
        }
        return block, log, env

    def run(
        self,
        tmp: Path,
        argv: list[str],
        quota: int,
        mode: Mode,
        stdin: str | None = None,
        timeout: float = 60,
        libdir: Path | None = None,
    ) -> tuple[subprocess.CompletedProcess, ControlBlock, Path]:
        block, log, env = self._under_shim(tmp, quota, mode, libdir)
        result = subprocess.run(
            argv, env=env, input=stdin, capture_output=True, text=True, timeout=timeout
        )
        return result, block, log

    def spawn(self, tmp: Path, code: str, quota: int, mode: Mode):
        """A Python program under the shim that stays alive: (process, block, log)."""
        block, log, env = self._under_shim(tmp, quota, mode)
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return proc, block, log


def kv(output: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split("=", 1) for line in output.split())}


@pytest.fixture(scope="session")
def fake(tmp_path_factory) -> Fake:
    d = tmp_path_factory.mktemp("fakecuda")
    src = str(HERE / "fake_cuda.c")
    cc(
        "-shared",
        "-fPIC",
        "-DFAKE_DRIVER",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        str(d / "libcuda.so.1"),
        src,
    )
    cc(
        "-shared",
        "-fPIC",
        "-DFAKE_RUNTIME",
        "-Wl,-soname,libcudart.so.13",
        "-o",
        str(d / "libcudart.so.13"),
        src,
        "-ldl",
    )
    (d / "libcudart.so").symlink_to("libcudart.so.13")
    # A driver that does not bind its own symbols: its table hands out the shim's.
    loose = d / "loose"
    loose.mkdir()
    cc(
        "-shared",
        "-fPIC",
        "-DFAKE_DRIVER",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        str(loose / "libcuda.so.1"),
        src,
    )
    (loose / "libcudart.so.13").symlink_to(d / "libcudart.so.13")
    cc(
        "-o",
        str(d / "probe"),
        str(HERE / "probe.c"),
        f"-L{d}",
        "-lcudart",
        "-ldl",
        "-lpthread",
        f"-Wl,-rpath,{d}",
    )
    return Fake(d, d / "probe", library_path(d / "shim"))

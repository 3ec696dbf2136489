"""Build libomnicuda.so with the system C compiler, once per source version.

No CUDA toolkit is needed: the shim declares the few CUDA types it uses. The
library lands in a cache directory named after the hash of its sources and
flags, so a changed source is rebuilt and concurrent builds do not collide.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2] / "native" / "omnicuda"
SOURCE_GLOBS = ("*.c", "*.h", "*.def")  # every file the library is built from
CFLAGS = ("-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-fvisibility=hidden")
LIBS = ("-ldl", "-lpthread")


class ShimBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    if env := os.environ.get("OMNI_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "omni"


def _sources() -> list[Path]:
    """The shim's source files, sorted: a file added to native/omnicuda is picked up."""
    paths = sorted(p for pattern in SOURCE_GLOBS for p in SOURCE_DIR.glob(pattern))
    if not any(p.suffix == ".c" for p in paths):
        raise ShimBuildError(f"{SOURCE_DIR}: no C sources (the shim's sources ship in native/)")
    return paths


def _digest(compiler: str, paths: list[Path]) -> str:
    h = hashlib.sha256(" ".join((compiler, *CFLAGS, *LIBS)).encode())
    for path in paths:
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def library_path(out_dir: Path | None = None) -> Path:
    """The built shim, compiling it first if this version is not built yet."""
    compiler = os.environ.get("CC", "cc")
    paths = _sources()
    target = (out_dir or cache_dir()) / f"omnicuda-{_digest(compiler, paths)}" / "libomnicuda.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    c_files = [str(p) for p in paths if p.suffix == ".c"]
    cmd = [compiler, *CFLAGS, "-o", tmp, *c_files, *LIBS]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        os.unlink(tmp)
        raise ShimBuildError(f"C compiler {compiler!r} not found (set CC)") from None
    if result.returncode != 0:
        os.unlink(tmp)
        raise ShimBuildError(f"building libomnicuda failed:\n{result.stderr}")
    os.chmod(tmp, 0o755)  # sandboxed instances load it as another uid
    os.replace(tmp, target)
    return target

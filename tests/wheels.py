"""Tiny real distributions for the per-model environment tests: wheels and an sdist written
byte for byte, so a test's wheelhouse holds exactly what it says and no build tool runs."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def write_wheel(
    wheelhouse: Path, name: str, version: str, requires: tuple[str, ...] = (), code: str = ""
) -> Path:
    """A pure-Python wheel of package `name` whose `VERSION` is `version` (plus `code`)."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n{code}",
        f"{dist_info}/METADATA": metadata,
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: omni-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    path = wheelhouse / f"{name}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            data = text.encode()
            whl.writestr(member, data)
            record.append(f"{member},{_record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        whl.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def write_sdist(wheelhouse: Path, name: str, version: str, setup_py: str) -> Path:
    """A source distribution only: installing it would run `setup_py`."""
    root = f"{name}-{version}"
    files = {
        f"{root}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{root}/setup.py": setup_py,
        f"{root}/{name}/__init__.py": f"VERSION = {version!r}\n",
    }
    path = wheelhouse / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for member, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()

"""Where OMNI keeps its runtime state (sockets) and its data (converted models)."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    """$OMNI_RUNTIME_DIR, else /run/omni as root, else $XDG_RUNTIME_DIR/omni."""
    if env := os.environ.get("OMNI_RUNTIME_DIR"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/omni")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/omni-{os.getuid()}"
    return Path(base) / "omni"


def data_dir() -> Path:
    """$OMNI_DATA_DIR, else /var/lib/omni as root, else $XDG_DATA_HOME/omni."""
    if env := os.environ.get("OMNI_DATA_DIR"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/omni")
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "omni"


def admin_socket(runtime: Path) -> Path:
    return runtime / "omnid.sock"


def instance_socket_dir(runtime: Path) -> Path:
    return runtime / "instances"

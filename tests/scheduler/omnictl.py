"""`omnictl cluster VIEW` as the cluster tests run it: a real process against a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def omnictl(endpoint: str, view: str, *flags: str, args: Sequence[str] = ()) -> str:
    """Its output; `flags` go before `cluster` (e.g. --json), `args` after the view."""
    argv = [sys.executable, "-m", "omni.ctl", *flags, "cluster", "--etcd", endpoint, view, *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def omnictl_json(endpoint: str, view: str, args: Sequence[str] = ()) -> dict:
    return json.loads(omnictl(endpoint, view, "--json", args=args))

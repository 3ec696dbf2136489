"""What a running sandbox leaves in omnid's workdir for it, so that a restarted omnid can
adopt it (live restore, as containerd re-adopts its shims).

The workdir (`<runtime_dir>/sandboxes/<name>/`) is root's alone; the instance never sees
it. It holds:

- `record.json`: the launcher's pid and start time (a pid alone could be a later
  process's), the instance's uid, the fingerprint of what it was started as (a changed
  config or code is not adopted), and the descriptors its init holds (control blocks);
- `owner`: the omnid that owns it, by pid and start time; the launcher ends the sandbox
  once no live omnid has owned it for its orphan timeout;
- `exit`: the instance's wait status, written by the launcher as it ends;
- `output`: the FIFO its output comes through (launch.py's Keeper).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

RECORD, OWNER, EXIT, OUTPUT = "record.json", "owner", "exit", "output"


def started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat.rpartition(b")")[2].split()[19])  # field 22, after "pid (comm)"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def claim(workdir: Path) -> None:
    """This omnid owns the sandbox now (its launcher watches the file)."""
    _write(workdir / OWNER, f"{os.getpid()} {started(os.getpid())}\n")


def exit_status(workdir: Path) -> int | None:
    """The instance's wait status, once its launcher wrote it."""
    try:
        return int((workdir / EXIT).read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Record:
    name: str
    launcher_pid: int
    launcher_started: int
    init_pid: int  # the sandbox's pid 1, as the host numbers it: holds `held_fds`
    uid: int
    fingerprint: str
    held_fds: tuple[int, ...] = ()

    def save(self, workdir: Path) -> None:
        _write(workdir / RECORD, json.dumps(asdict(self)))

    @classmethod
    def load(cls, workdir: Path) -> Record | None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads((workdir / RECORD).read_text())
            return cls(**{**data, "held_fds": tuple(data.get("held_fds", ()))})
        return None

    def alive(self) -> bool:
        """Its launcher still runs (the same process, not a later one with its pid)."""
        return started(self.launcher_pid) == self.launcher_started

"""Host-wide uids for sandboxed instances: no two omnids on one host hand out the same one.

An instance's uid is its own: RLIMIT_NPROC, signals and file ownership go by uid, so a
uid two instances share lets one keep the other from starting. The leases live in one
JSON table (root's; /run/omni-uids by default, outside any runtime dir) that every omnid
of the host reads and writes under an flock. A lease is keyed by its daemon (the
resolved runtime dir) and the instance's name, and records the daemon's pid and start
time. It is dropped on unload, or once its daemon is gone and no process runs as its uid
any more; a uid some process still runs as, or that a real account or group has, is
never handed out.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path

UIDS = range(200_000, 265_536)  # outside the range of any real account


class UidError(RuntimeError):
    pass


def started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None once it is gone: with the
    pid, it tells a live daemon from a later process that got the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22, after "pid (comm)"


def ids_in_use() -> set[int]:
    """Every uid and gid (real, effective, saved, filesystem) some process runs as."""
    ids: set[int] = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:  # exited meanwhile
            continue
        for line in lines:
            if line.startswith(("Uid:", "Gid:")):
                ids.update(int(i) for i in line.split()[1:])
    return ids


def has_account(uid: int) -> bool:
    """A user or group of the host has this id (instances run with gid = uid)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        with contextlib.suppress(KeyError):
            lookup(uid)
            return True
    return False


class UidAllocator:
    """The host's uid table at `path`; lease(owner, name) and release(owner, name)."""

    def __init__(self, path: Path, uids: range = UIDS):
        self.path, self.uids = path, uids
        self.lock_path = path.with_name(path.name + ".lock")

    def lease(self, owner: str, name: str) -> int:
        """The uid of instance `name` of daemon `owner`: the one it had, else a free one."""
        me = {"owner": owner, "name": name, "pid": os.getpid(), "started": started(os.getpid())}
        with self._table() as table:
            uid = find(table, owner, name)
            if uid is not None:
                lease = table[uid]
                if lease["pid"] != me["pid"] and alive(lease):
                    raise UidError(
                        f"instance {name!r} of {owner} is leased by another live omnid "
                        f"(pid {lease['pid']}): two omnids share one runtime dir"
                    )
            else:
                uid = self._free(table)
            table[uid] = me
            return uid

    def release(self, owner: str, name: str) -> None:
        """Give the instance's uid back (on unload, once its processes are gone)."""
        with self._table() as table:
            uid = find(table, owner, name)
            if uid is not None:
                del table[uid]

    def leases(self) -> dict[int, dict]:
        with self._table() as table:
            return table

    def _free(self, table: dict[int, dict]) -> int:
        """The lowest uid nobody holds: no live lease, no process, no account. Leases of
        daemons that are gone are dropped here, unless a process still runs as theirs."""
        busy = ids_in_use()
        for uid in [u for u, lease in table.items() if not alive(lease) and u not in busy]:
            del table[uid]
        for uid in self.uids:
            if uid not in table and uid not in busy and not has_account(uid):
                return uid
        raise UidError(f"no free sandbox uid in {self.uids.start}..{self.uids.stop - 1}")

    @contextlib.contextmanager
    def _table(self) -> Iterator[dict[int, dict]]:
        """The table, locked against every other omnid; written back if it changed."""
        self._check_dir()
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.lock_path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            table = self._read()
            before = json.dumps(table, sort_keys=True)
            yield table
            if json.dumps(table, sort_keys=True) != before:
                self._write(table)
        finally:
            os.close(fd)  # (and the lock with it)

    def _check_dir(self) -> None:
        """Created if missing (0755: /run/omni is also root's default runtime dir, which
        the admin group traverses); refused when anyone but us may write to it."""
        directory = self.path.parent
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = directory.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UidError(f"{directory}: the uid table's directory must be ours alone")

    def _read(self) -> dict[int, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise UidError(f"{self.path}: unreadable ({exc})") from None
        return {int(uid): lease for uid, lease in data.items()}

    def _write(self, table: dict[int, dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, 0o600), "w") as f:
            json.dump({str(uid): table[uid] for uid in sorted(table)}, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def find(table: dict[int, dict], owner: str, name: str) -> int | None:
    return next((u for u, e in table.items() if (e["owner"], e["name"]) == (owner, name)), None)


def alive(lease: dict) -> bool:
    """The lease's daemon still runs (the same process, not a later one with its pid)."""
    start = started(lease["pid"])
    return start is not None and start == lease["started"]

"""omnid's file operations on paths an instance can reach, none of which follows a link.

An instance runs hostile code as its own uid, and omnid (root) must never be steered
by what it planted: a symlink where omnid expects its own file, a socket that is some
other daemon's, a file swapped in for a handoff. The rules here:

- An instance's directory is omnid's (root-owned, 0755): the instance can write the
  files omnid gives it, never add, rename or replace an entry. It is made anew at
  every start, whatever was there before removed without following links.
- Files omnid creates are created exclusively (O_EXCL | O_NOFOLLOW, relative to a
  directory descriptor) and changed through their descriptor (fchown, fchmod).
- A block the instance writes and omnid maps is a sealed memfd handed to its sandbox:
  the instance cannot shrink it, which would make omnid's next read a SIGBUS.
- The instance's own writable directory is a size-limited tmpfs (its pages are charged
  to the writer's memory cgroup), mounted fresh at each start and unmounted at stop.
- omnid reaches an instance's socket through an O_PATH descriptor opened without
  following links, and talks on the connection only once SO_PEERCRED names the
  instance's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from . import launch  # standard library only: the launcher runs alone

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MFD_CLOEXEC, MFD_ALLOW_SEALING = 0x1, 0x2
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW = 0x1, 0x2, 0x4
MNT_DETACH, UMOUNT_NOFOLLOW = 0x2, 0x8
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)

PeerCheck = Callable[[int, int], bool]  # (pid, uid) of a socket's listener -> allowed


class UnsafePath(OSError):
    """A path omnid was to act on is not what omnid made: a link, a foreign owner."""


def _check(result: int, what: str, path: Path | str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", str(path))
    return result


def mount_points_under(path: Path) -> list[Path]:
    """Mount points at or below `path` in omnid's mount namespace, deepest first."""
    points = {Path(p) for p in launch.mount_points_under(str(path))}
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def unmount_all(path: Path) -> None:
    """Detach every mount at or below `path` (an instance's tmpfs, its bound blocks)."""
    for point in mount_points_under(path):
        if _libc.umount2(os.fsencode(point), MNT_DETACH | UMOUNT_NOFOLLOW) == -1:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount
                raise OSError(err, f"umount: {os.strerror(err)}", str(point))


def remove_tree(path: Path) -> None:
    """Unmount and remove `path`, never following a link inside it (a planted link is
    removed itself; rmtree walks by descriptors on Linux)."""
    unmount_all(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def fresh_dir(path: Path, mode: int = 0o755, owner: int | None = None) -> None:
    """`path` as a new empty directory (root's, or `owner`'s), whatever was there.

    Its parent must be omnid's own: only the last component is new."""
    remove_tree(path)
    os.mkdir(path, mode)
    fd = os.open(path, DIR_FLAGS)
    try:
        if owner is not None:
            os.fchown(fd, owner, owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes, mode: int, owner: int | None = None) -> None:
    """A new file at `path` (never an existing one, never through a link), its owner and
    mode set through the descriptor."""
    dir_fd = os.open(path.parent, DIR_FLAGS)
    try:
        fd = os.open(path.name, CREATE_FLAGS | os.O_WRONLY, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.write(fd, data)
        if owner is not None:
            os.fchown(fd, owner, owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def sealed_memfd(name: str, data: bytes, mode: int, owner: int | None = None) -> int:
    """A memory file holding `data`, its size sealed: whoever may write it (`owner`) can
    change its bytes, never shrink it, which would make omnid's next read of its mapping
    a SIGBUS. The descriptor is close-on-exec; a sandbox is handed it explicitly."""
    fd = _check(_libc.memfd_create(name.encode(), MFD_CLOEXEC | MFD_ALLOW_SEALING), "memfd", name)
    try:
        os.write(fd, data)
        if owner is not None:
            os.fchown(fd, owner, owner)
        os.fchmod(fd, mode)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def mount_tmpfs(path: Path, size_bytes: int, owner: int, mode: int = 0o700) -> None:
    """A fresh tmpfs of at most `size_bytes` on the new directory `path`, `owner`'s,
    nothing on it executable, set-uid or a device."""
    fresh_dir(path, 0o700)
    options = f"size={max(size_bytes, 4096)},mode={mode:o},uid={owner},gid={owner},nr_inodes=4096"
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _check(
        _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(flags), options.encode()),
        "tmpfs",
        path,
    )


def usage_bytes(path: Path) -> int:
    """Bytes of disk the files under `path` take, walked without following a link."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
    return total


def open_dir(path: Path) -> int:
    """A descriptor of the directory `path` whose last component is not a link."""
    return os.open(path, DIR_FLAGS)


def copy_file(
    src_dir: Path, name: str, src_owner: int | None, dst_dir: Path, dst_owner: int | None
) -> int:
    """Copy the regular file `name` (`src_owner`'s) from one instance's directory into a new
    file of another's, given to `dst_owner`, mode 0600; the bytes copied. Neither side is
    reached through a link; an existing target is an error (EEXIST)."""
    src_fd = os.open(
        name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=(sd := open_dir(src_dir))
    )
    os.close(sd)
    try:
        st = os.fstat(src_fd)
        if not stat.S_ISREG(st.st_mode) or (src_owner is not None and st.st_uid != src_owner):
            raise UnsafePath(
                errno.EPERM, "not a regular file of the instance's own", str(src_dir / name)
            )
        dst_fd = os.open(name, CREATE_FLAGS | os.O_WRONLY, 0o600, dir_fd=(dd := open_dir(dst_dir)))
        os.close(dd)
        try:
            copied = 0
            while n := os.sendfile(dst_fd, src_fd, None, 1 << 30):
                copied += n
            if dst_owner is not None:
                os.fchown(dst_fd, dst_owner, dst_owner)
            os.fchmod(dst_fd, 0o600)
            return copied
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=(dd := open_dir(dst_dir)))
                os.close(dd)
            raise
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that listens on a connected Unix socket's other end."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


async def connect_checked(path: Path, allowed: PeerCheck) -> socket.socket:
    """A connected, non-blocking Unix socket to `path`: its last component a socket
    itself (never followed as a link) and its listener a process `allowed` names."""
    try:
        ref = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConnectionRefusedError(exc.errno, exc.strerror, str(path)) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not stat.S_ISSOCK(os.fstat(ref).st_mode):
            raise UnsafePath(errno.ECONNREFUSED, "not a socket", str(path))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, f"/proc/self/fd/{ref}")
        pid, uid = peer_of(sock)
        if not allowed(pid, uid):
            raise UnsafePath(
                errno.ECONNREFUSED, f"listener pid {pid} uid {uid} is not the instance", str(path)
            )
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(ref)
    return sock

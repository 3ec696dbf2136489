"""Sandbox launcher: the mechanism half of a sandbox. omnid decides the policy.

Run as `python -I -S launch.py PLAN_FILE`, importing only the standard
library so it starts in milliseconds. omnid has already put this process in
the instance's cgroup (before exec), so everything below is accounted there.

    launcher (host pid namespace)
      start the thread that will answer sysinfo (none can start after unshare(pid))
      unshare(pid, mount, uts, ipc, net, cgroup); bring up lo, its only interface
      fork ──> init (pid 1 of the new namespace)
                 vm.memfd_noexec = 2 for the namespace,
                 private mounts, tmpfs root, bind mounts (read-only all the way down),
                 /proc, a /sys of allowed parts, its own cgroup, /dev, pivot_root,
                 hostname, rlimits, drop capabilities, setuid, no_new_privs, seccomp
                 (its notification listener handed to the launcher)
                 fork ──> the instance (exec)
                 reap orphans, forward signals; exit when the instance exits,
                 which makes the kernel kill whatever is left in the namespace
      answer the instance's sysinfo(2) calls (the thread, through init's listener);
      forward signals to init; report the instance's wait status as its own

A step that fails (a mount, the exec) is reported to omnid on the error pipe as
(step, path, reason); the pipe closes without a report once the instance's exec
succeeded, so omnid knows the sandbox is up or exactly why it is not.
"""

from __future__ import annotations

# The C modules under `signal` and `socket`: the wrappers import enum, 3.6 ms of our
# start-up here.
import _signal as signal
import _socket
import _thread
import ctypes
import errno
import marshal
import os
import resource
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x20000000, 0x40000000, 0x02000000
NAMESPACES = (
    CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWCGROUP
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8  # = the MOUNT_ATTR_ bits
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 0x8
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
AF_INET, SOCK_DGRAM, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 2, 2, 0x8913, 0x8914, 0x1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[os.uname().machine]
SYS_MOUNT_SETATTR = 442  # Linux 5.12+, the same number on x86-64 and arm64
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}[os.uname().machine]
SYS_SYSINFO = {"x86_64": 99, "aarch64": 179}[os.uname().machine]
# SECCOMP_IOCTL_NOTIF_*: _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, struct
# seccomp_notif_resp), _IOW('!', 2, __u64); the same on x86-64 and arm64.
NOTIF_RECV, NOTIF_SEND, NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
# Per pid namespace (Linux 6.3+): 2 makes every memfd non-executable, and refuses MFD_EXEC.
MEMFD_NOEXEC = "/proc/sys/vm/memfd_noexec"
SETUP_FAILED = 125  # exit code when the sandbox itself could not be built
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
RO_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV
SYSFS_STAGE = "/.sysfs"  # where a fresh sysfs is mounted while its allowed parts are bound

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the sandbox failed: which step, on which path, and why."""

    def __init__(self, step: str, path: str, reason: str):
        super().__init__(f"{step} {path}: {reason}" if path else f"{step}: {reason}")
        self.step, self.path, self.reason = step, path, reason


def check(result: int, step: str, path: str = "") -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise SetupError(step, path, f"{os.strerror(err)} (errno {err})")
    return result


def mount(
    src: str | None,
    dst: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
    step: str = "mount",
):
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    check(
        libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        step,
        src if src and src.startswith("/") else dst,
    )


class MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def mount_points_under(path: str) -> list[str]:
    """Mount points at or below `path` in this mount namespace, parents first (omnid's
    hostfs reads its own namespace's with it too)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n")):
                point = point.replace(escaped, char)
            point = point.replace("\\134", "\\")
            if point == path or point.startswith(path.rstrip("/") + "/"):
                out.append(point)
    return sorted(out, key=len)


def restrict_tree(path: str, flags: int) -> None:
    """Set read-only/nosuid/nodev/noexec on a bind mount and every mount below it.

    A remount of a recursive bind changes its top mount alone, so the host's sub-mounts
    (cgroup controllers under /sys, a disk under a model directory) would stay writable.
    """
    attr = MountAttr(attr_set=flags)
    result = libc.syscall(
        SYS_MOUNT_SETATTR,
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if result == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        check(result, "read-only", path)
    for point in mount_points_under(path):  # before Linux 5.12: one remount each
        mount(None, point, None, MS_REMOUNT | MS_BIND | flags, step="read-only")


def prctl(option: int, arg: int = 0) -> int:
    return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def make_target(path: str, is_dir: bool) -> None:
    if is_dir:
        if not os.path.isdir(path):  # mkdir on a read-only mount fails even if it exists
            os.makedirs(path)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.lexists(path):
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def bind(src: str, dst: str, flags: int) -> None:
    """A recursive bind of `src` on `dst`, `flags` applied to every mount in it."""
    make_target(dst, os.path.isdir(src))
    mount(src, dst, None, MS_BIND | MS_REC, step="bind")
    restrict_tree(dst, flags)


def mount_sysfs(root: str, m: dict) -> None:
    """/sys holding only the allowed parts of a sysfs mounted in the new network
    namespace (so its class/net would show loopback alone, were it allowed)."""
    stage = root + SYSFS_STAGE
    os.mkdir(stage)
    mount("sysfs", stage, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, step="sysfs")
    for part in m["parts"]:
        if os.path.exists(f"{stage}/{part}"):  # optional: a kernel without NUMA has no node/
            bind(f"{stage}/{part}", f"{root}{m['dst']}/{part}", RO_FLAGS | MS_NOEXEC)
    check(libc.umount2(stage.encode(), MNT_DETACH), "sysfs", stage)
    os.rmdir(stage)


def apply_mount(root: str, m: dict) -> None:
    """One entry of the plan omnid built; paths are absolute inside the sandbox."""
    dst = root + m["dst"]
    kind = m["type"]
    try:
        if kind == "symlink":
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(m["target"], dst)
        elif kind == "dir":
            os.makedirs(dst, exist_ok=True)
            os.chmod(dst, m.get("mode", 0o755))
        elif kind == "tmpfs":
            make_target(dst, True)
            flags = MS_NOSUID | MS_NODEV | m.get("flags", 0)
            mount("tmpfs", dst, "tmpfs", flags, m.get("options"), step="tmpfs")
        elif kind == "proc":
            make_target(dst, True)
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | m.get("flags", 0)  # MS_RDONLY
            mount("proc", dst, "proc", flags, step="proc")
            for part in m.get("readonly", ()):  # of a writable /proc: the kernel's knobs
                if os.path.exists(f"{dst}/{part}"):
                    bind(f"{dst}/{part}", f"{dst}/{part}", RO_FLAGS | MS_NOEXEC)
        elif kind == "sysfs":
            mount_sysfs(root, m)
        elif kind == "cgroup":  # in our cgroup namespace: rooted at the instance's own group
            make_target(dst, True)
            flags = RO_FLAGS | MS_NOEXEC
            mount("cgroup", dst, m["fstype"], flags, m.get("options"), step="cgroup")
        elif kind == "bind":
            flags = MS_NOSUID
            if not m.get("device"):
                flags |= MS_NODEV
            if m.get("ro", True):
                flags |= MS_RDONLY
            if m.get("noexec"):
                flags |= MS_NOEXEC
            bind(m["src"], dst, flags)
        else:
            raise SetupError("plan", m["dst"], f"unknown mount type {kind!r}")
    except OSError as exc:
        raise SetupError(kind, m.get("src", m["dst"]), exc.strerror or str(exc)) from None


def pivot_into(root: str) -> None:
    os.chdir(root)
    os.mkdir(".oldroot")
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b".oldroot"), "pivot_root", root)
    os.chdir("/")
    check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | RO_FLAGS, step="read-only root")


def drop_privileges(plan: dict) -> None:
    for name, (soft, hard) in plan.get("rlimits", {}).items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    cap = 0
    while prctl(PR_CAPBSET_DROP, cap) == 0:  # EINVAL past the last capability
        cap += 1
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups([])
    os.setresgid(plan["gid"], plan["gid"], plan["gid"])
    os.setresuid(plan["uid"], plan["uid"], plan["uid"])  # clears permitted/effective caps
    check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")


def deny_exec_memfds() -> None:
    """vm.memfd_noexec = 2 in the sandbox's pid namespace (we are its init, still root,
    the host's /proc still mounted): a memfd the instance writes can never be executed
    (execve of /proc/self/fd/N; seccomp refuses fexecve). Before Linux 6.3 there is none."""
    if not os.path.exists(MEMFD_NOEXEC):
        return
    try:
        fd = os.open(MEMFD_NOEXEC, os.O_WRONLY)
        try:
            os.write(fd, b"2")
        finally:
            os.close(fd)
    except OSError as exc:
        raise SetupError("memfd_noexec", MEMFD_NOEXEC, exc.strerror or str(exc)) from None


class SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def load_seccomp(bpf: bytes) -> int:
    """Install omnid's prebuilt filter (raw struct sock_filter[]); needs no_new_privs.
    Returns the listener for the calls it leaves to us (seccomp.NOTIFIED)."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    flags = ctypes.c_uint(SECCOMP_FILTER_FLAG_NEW_LISTENER)
    listener = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog))
    return check(listener, "seccomp")


class SeccompData(ctypes.Structure):
    _fields_ = (
        ("nr", ctypes.c_int),
        ("arch", ctypes.c_uint32),
        ("instruction_pointer", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 6),
    )


class Notif(ctypes.Structure):  # struct seccomp_notif
    _fields_ = (
        ("id", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),  # in our (the host's) pid namespace
        ("flags", ctypes.c_uint32),
        ("data", SeccompData),
    )


class NotifResp(ctypes.Structure):  # struct seccomp_notif_resp
    _fields_ = (
        ("id", ctypes.c_uint64),
        ("val", ctypes.c_int64),
        ("error", ctypes.c_int32),  # 0 or -errno
        ("flags", ctypes.c_uint32),
    )


class SysInfo(ctypes.Structure):  # struct sysinfo
    _fields_ = (
        ("uptime", ctypes.c_long),
        ("loads", ctypes.c_ulong * 3),
        ("totalram", ctypes.c_ulong),
        ("freeram", ctypes.c_ulong),
        ("sharedram", ctypes.c_ulong),
        ("bufferram", ctypes.c_ulong),
        ("totalswap", ctypes.c_ulong),
        ("freeswap", ctypes.c_ulong),
        ("procs", ctypes.c_ushort),
        ("pad", ctypes.c_ushort),
        ("totalhigh", ctypes.c_ulong),
        ("freehigh", ctypes.c_ulong),
        ("mem_unit", ctypes.c_uint),
        ("_f", ctypes.c_char * (20 - 2 * ctypes.sizeof(ctypes.c_ulong) - 4)),
    )


class SysinfoServer:
    """Answers the instance's sysinfo(2) (a seccomp user notification) with its own
    figures: its memory limit as all the RAM (free: the limit less its cgroup's usage),
    no swap, no load, one process, the sandbox's age as uptime. The host's would tell
    of its RAM, load and process count; and glibc's sysconf(_SC_PHYS_PAGES) reads the
    struct whatever sysinfo returns, so an errno would hand it garbage.

    Runs on a thread of the launcher, root in the host's pid namespace: the caller's pid
    is a host pid, its memory written through the host's /proc (a directory descriptor
    opened before the sandbox's namespaces were made). Init loads the filter and hands
    the listener over a socket pair; the instance never holds it.
    """

    def __init__(self, memory_bytes: int | None):
        self.memory_bytes = memory_bytes
        self.started = time.monotonic()
        self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
        self.usage = _memory_usage_file()
        self.sock, self.init_sock = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)

    def close_in_init(self) -> None:
        """Init keeps none of the launcher's descriptors: only its end of the socket."""
        for fd in (self.proc, self.usage):
            if fd is not None:
                os.close(fd)
        self.sock.close()

    def hand_over(self, listener: int) -> None:
        """In init: pass the filter's listener to the launcher, keep no copy of it."""
        fd = listener.to_bytes(4, sys.byteorder)
        self.init_sock.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd)])
        os.close(listener)

    def start(self) -> None:
        """Serve on a thread of the launcher, started before unshare(CLONE_NEWPID) (after
        it, the kernel refuses new threads), waiting for init's listener. It never takes
        the signals we forward: the main thread, waiting in waitpid, must see them."""
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        _thread.start_new_thread(self.serve, ())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)

    def serve(self) -> None:
        listener = self._receive_listener()
        if listener is None:  # init failed, or no filter: nothing will ask
            return
        notif = Notif()
        while True:
            ctypes.memset(ctypes.byref(notif), 0, ctypes.sizeof(notif))  # the kernel checks
            if libc.ioctl(listener, ctypes.c_ulong(NOTIF_RECV), ctypes.byref(notif)) == -1:
                if ctypes.get_errno() in (errno.EINTR, errno.ENOENT):  # ENOENT: caller died
                    continue
                return
            resp = NotifResp(id=notif.id, error=-errno.ENOSYS)
            if notif.data.nr == SYS_SYSINFO:
                try:  # every notification gets its answer: a caller left waiting would hang
                    resp.error = self._answer(listener, notif)
                except Exception:
                    resp.error = -errno.EFAULT
            libc.ioctl(listener, ctypes.c_ulong(NOTIF_SEND), ctypes.byref(resp))  # ENOENT: died

    def _receive_listener(self) -> int | None:
        try:
            _, ancillary, _, _ = self.sock.recvmsg(1, _socket.CMSG_SPACE(4))
        except OSError:
            return None
        finally:
            self.sock.close()
        for level, kind, data in ancillary:
            if (level, kind) == (_socket.SOL_SOCKET, _socket.SCM_RIGHTS):
                return int.from_bytes(data[:4], sys.byteorder)
        return None

    def _answer(self, listener: int, notif: Notif) -> int:
        """Write the struct into the caller's buffer: 0, or -EFAULT as the kernel would."""
        info = bytes(self.sysinfo())
        try:
            mem = os.open(f"{notif.pid}/mem", os.O_WRONLY, dir_fd=self.proc)
        except OSError:
            return -errno.EFAULT
        try:
            # The pid was still the caller's when opened (the reply would fail otherwise):
            # never write into a process that took over a dead caller's pid.
            request = ctypes.c_uint64(notif.id)
            if libc.ioctl(listener, ctypes.c_ulong(NOTIF_ID_VALID), ctypes.byref(request)):
                return -errno.ENOENT
            os.pwrite(mem, info, notif.data.args[0])
        except OSError:  # EIO: an unmapped address
            return -errno.EFAULT
        finally:
            os.close(mem)
        return 0

    def sysinfo(self) -> SysInfo:
        host = SysInfo()
        libc.sysinfo(ctypes.byref(host))
        total, free = host.totalram * host.mem_unit, host.freeram * host.mem_unit
        if self.memory_bytes:
            used = int(os.pread(self.usage, 32, 0)) if self.usage is not None else 0
            total, free = self.memory_bytes, max(0, self.memory_bytes - used)
        uptime = int(time.monotonic() - self.started)
        return SysInfo(uptime=uptime, totalram=total, freeram=free, procs=1, mem_unit=1)


def _memory_usage_file() -> int | None:
    """Our memory cgroup's usage file (omnid put us in the instance's group), opened
    while the host's /sys is in view; None where it is not at the usual place."""
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            name = f"/sys/fs/cgroup{path}/memory.current".replace("//", "/")
        elif "memory" in controllers.split(","):
            name = f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes".replace("//", "/")
        else:
            continue
        try:
            return os.open(name, os.O_RDONLY)
        except OSError:
            continue
    return None


class Keeper:
    """What lets the sandbox outlive omnid (live restore) without being orphaned for long.

    - Its output: the instance's stdout and stderr go through a pipe to a thread here,
      which writes them to the FIFO in omnid's workdir for the sandbox; omnid reads it,
      this one or the next. Never blocked and never broken by omnid's death: what no
      omnid reads while the FIFO is full is dropped.
    - Its owner: the omnid named (pid and start time) in the workdir's `owner` file, which
      a new omnid rewrites when it adopts the sandbox. Once no live omnid has owned it for
      `orphan_timeout_s`, the sandbox is ended: SIGTERM to its init, SIGKILL after a grace.
    - Its end: the instance's wait status, written to the workdir's `exit` file for an
      omnid that is not our parent.

    Both threads start before unshare(CLONE_NEWPID) (after it, the kernel refuses new
    threads); the workdir and the host's /proc are reached through descriptors opened
    now, before pivot_root takes them out of sight.
    """

    GRACE_S = 10.0

    def __init__(self, plan: dict):
        self.dir = os.open(plan["workdir"], os.O_RDONLY | os.O_DIRECTORY)
        self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
        self.timeout_s = plan.get("orphan_timeout_s", 60.0)
        self.init: int | None = None
        self.output_r: int | None = None
        self.fifo: int | None = None
        if plan.get("output"):
            self.fifo = os.open(plan["output"], os.O_RDWR | os.O_NONBLOCK)
            self.output_r, w = os.pipe()
            os.dup2(w, 1)
            os.dup2(w, 2)
            os.close(w)

    def start(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # the main thread's to handle
        if self.fifo is not None:
            _thread.start_new_thread(self.pump, ())
        _thread.start_new_thread(self.watch, ())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)

    def close_in_init(self) -> None:
        for fd in (self.dir, self.proc, self.output_r, self.fifo):
            if fd is not None:
                os.close(fd)

    def pump(self) -> None:
        while chunk := os.read(self.output_r, 65536):
            try:  # noqa: SIM105 - importing contextlib would cost start-up time
                os.write(self.fifo, chunk)
            except BlockingIOError:  # no omnid keeping up: dropped
                pass

    def owned(self) -> bool:
        """A live omnid (pid and start time as the owner file says) owns the sandbox."""
        try:
            fd = os.open("owner", os.O_RDONLY, dir_fd=self.dir)
            try:
                pid, started = os.read(fd, 64).split()
            finally:
                os.close(fd)
            fd = os.open(f"{int(pid)}/stat", os.O_RDONLY, dir_fd=self.proc)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return False
        return stat.rpartition(b")")[2].split()[19] == started

    def watch(self) -> None:
        alone_since = None
        while True:
            time.sleep(0.5)
            if self.owned():
                alone_since = None
                continue
            alone_since = alone_since or time.monotonic()
            if self.init is None or time.monotonic() - alone_since < self.timeout_s:
                continue
            os.write(2, f"omni sandbox: no omnid for {self.timeout_s:.0f} s: stopping\n".encode())
            for sig, wait_s in ((signal.SIGTERM, self.GRACE_S), (signal.SIGKILL, 0)):
                try:
                    os.kill(self.init, sig)
                except ProcessLookupError:
                    return
                time.sleep(wait_s)
            return

    def record_exit(self, status: int) -> None:
        """The instance's wait status, for an omnid that cannot wait for us."""
        try:
            fd = os.open("exit", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=self.dir)
            os.write(fd, str(status).encode())
            os.close(fd)
        except OSError:
            pass


def build_view(plan: dict) -> None:
    root = plan["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE, step="private mounts")  # nothing leaks out
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m", step="root")
    for m in plan["mounts"]:
        apply_mount(root, m)
    pivot_into(root)
    hostname = plan["hostname"].encode()
    check(libc.sethostname(hostname, len(hostname)), "sethostname", plan["hostname"])


def forward_signals(to_pid: int) -> None:
    def forward(sig, _frame):
        try:  # noqa: SIM105 - importing contextlib would cost start-up time
            os.kill(to_pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)


class IfReq(ctypes.Structure):  # struct ifreq, as SIOC[GS]IFFLAGS read it
    _fields_ = (
        ("name", ctypes.c_char * 16),
        ("flags", ctypes.c_short),
        ("pad", ctypes.c_char * 22),
    )


def loopback_up() -> None:
    """Bring up lo in our new network namespace, where we are root: its only interface."""
    fd = check(libc.socket(AF_INET, SOCK_DGRAM, 0), "loopback", "lo")
    try:
        req = IfReq(b"lo")
        check(libc.ioctl(fd, ctypes.c_ulong(SIOCGIFFLAGS), ctypes.byref(req)), "loopback", "lo")
        req.flags |= IFF_UP
        check(libc.ioctl(fd, ctypes.c_ulong(SIOCSIFFLAGS), ctypes.byref(req)), "loopback", "lo")
    finally:
        os.close(fd)


def fork(reason: str) -> int:
    """os.fork, a refusal for the process limit told as such (`reason`: which limit)."""
    try:
        return os.fork()
    except BlockingIOError:  # EAGAIN
        raise SetupError("fork", "", f"{os.strerror(errno.EAGAIN)}: {reason}") from None


def _process_limits(plan: dict) -> str:
    """What refuses the instance's fork with EAGAIN, for the setup report."""
    nproc = plan.get("rlimits", {}).get("RLIMIT_NPROC")
    rlimit = f"RLIMIT_NPROC {nproc[0]}, " if nproc else ""
    return (
        f"the process limit of uid {plan['uid']} was reached ({rlimit}which counts all "
        "its processes on the host), or the cgroup's pids.max"
    )


def hold_fds(fds: list[int]) -> None:
    """Descriptors omnid handed over (sealed control blocks): init keeps them for the
    instance's processes to open as /proc/1/fd/N, any of them, however started; none
    inherits them. setresuid cleared init's dumpable flag, without which a process of its
    uid may not open them: set again (init holds nothing the instance could not have)."""
    for fd in fds:
        os.set_inheritable(fd, False)
    if fds:
        prctl(PR_SET_DUMPABLE, 1)


def run_init(
    plan: dict,
    seccomp: bytes | None,
    status_w: int,
    err_w: int,
    server: SysinfoServer,
    keeper: Keeper,
) -> None:
    """pid 1 of the sandbox: build the view, start the instance, reap, report."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    server.close_in_init()
    keeper.close_in_init()
    deny_exec_memfds()
    build_view(plan)
    drop_privileges(plan)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of credentials cleared it
    if seccomp:
        server.hand_over(load_seccomp(seccomp))
    server.init_sock.close()
    hold_fds(plan.get("held_fds", ()))
    os.chdir(plan.get("cwd", "/"))
    argv = plan["argv"]
    child = fork(_process_limits(plan))
    if child == 0:  # a failure here reaches main's handler too, and the error pipe
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            os.execve(argv[0], argv, plan["env"])  # closes err_w (close-on-exec)
        except OSError as exc:
            raise SetupError("exec", argv[0], exc.strerror or str(exc)) from None
    os.close(err_w)  # now only the instance holds it, until its exec
    forward_signals(child)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if pid == child:
            os.write(status_w, str(status).encode())
            os._exit(0)


def report_failure(err_w: int, hostname: str, exc: BaseException) -> None:
    """Tell omnid (the error pipe) and the instance's log which step failed."""
    if not isinstance(exc, SetupError):
        if isinstance(exc, OSError):
            exc = SetupError("setup", exc.filename or "", exc.strerror or str(exc))
        else:
            exc = SetupError("setup", "", repr(exc))
    try:  # noqa: SIM105 - importing contextlib would cost start-up time
        os.write(err_w, marshal.dumps((exc.step, exc.path, exc.reason)))
    except OSError:
        pass
    os.write(2, f"omni sandbox {hostname}: {exc}\n".encode())


def main() -> None:
    with open(sys.argv[1], "rb") as f:  # root-only file in omnid's runtime dir
        plan = marshal.load(f)  # not json: its import alone would double our start-up
    err_w = plan["error_fd"]
    os.set_inheritable(err_w, False)  # the instance's exec closes it: omnid's "it runs"
    try:
        seccomp = None
        if plan.get("seccomp"):  # read now: the file is out of sight after pivot_root
            with open(plan["seccomp"], "rb") as f:
                seccomp = f.read()
        server = SysinfoServer(plan.get("memory_bytes"))
        server.start()
        keeper = Keeper(plan)
        keeper.start()
        check(libc.unshare(NAMESPACES), "unshare")
        loopback_up()
        status_r, status_w = os.pipe()
        init = fork("the instance's cgroup is at its pids.max")
    except (SetupError, OSError) as exc:
        report_failure(err_w, plan["hostname"], exc)
        os._exit(SETUP_FAILED)
    if init == 0:
        os.close(status_r)
        try:
            run_init(plan, seccomp, status_w, err_w, server, keeper)
        except BaseException as exc:  # report, never fall back into the launcher's code
            report_failure(err_w, plan["hostname"], exc)
            os._exit(SETUP_FAILED)
    os.close(err_w)
    os.close(status_w)
    server.init_sock.close()  # init's end: the listener comes through it, or EOF
    keeper.init = init
    forward_signals(init)
    while True:
        try:
            _, init_status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    report = os.read(status_r, 32)
    if not report:  # init failed before the instance ran (or was killed: an orphan)
        code = os.waitstatus_to_exitcode(init_status) if os.WIFEXITED(init_status) else None
        keeper.record_exit(init_status)
        os._exit(SETUP_FAILED if code is None else code)
    try:
        status = int(report)
    except ValueError:  # written by no init of ours
        status = init_status
    keeper.record_exit(status)
    if os.WIFSIGNALED(status):  # die the same way, so omnid sees the real signal
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    try:
        main()
    except (SetupError, OSError) as exc:
        os.write(2, f"omni sandbox: {exc}\n".encode())
        os._exit(SETUP_FAILED)

"""Sandbox launcher: the mechanism half of a sandbox. omnid decides the policy.

Run as `python -I -S launch.py PLAN_FILE`, importing only the standard
library so it starts in milliseconds. omnid has already put this process in
the instance's cgroup (before exec), so everything below is accounted there.

    launcher (host pid namespace)
      unshare(pid, mount, uts, ipc, net); tell omnid, which brings lo up meanwhile
      fork ──> init (pid 1 of the new namespace)
                 private mounts, tmpfs root, bind mounts, /proc, /dev, pivot_root,
                 hostname, rlimits, drop capabilities, setuid, no_new_privs, seccomp
                 wait for omnid's go-ahead (network ready)
                 fork ──> the instance (exec)
                 reap orphans, forward signals; exit when the instance exits,
                 which makes the kernel kill whatever is left in the namespace
      forward signals to init; report the instance's wait status as its own
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[os.uname().machine]
SETUP_FAILED = 125  # exit code when the sandbox itself could not be built
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return result


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    check(
        libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {src or fstype} on {dst}",
    )


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


def apply_mount(root: str, m: dict) -> None:
    """One entry of the plan omnid built; paths are absolute inside the sandbox."""
    dst = root + m["dst"]
    kind = m["type"]
    if kind == "symlink":
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(m["target"], dst)
    elif kind == "dir":
        os.makedirs(dst, exist_ok=True)
        os.chmod(dst, m.get("mode", 0o755))
    elif kind == "tmpfs":
        make_target(dst, True)
        mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV | m.get("flags", 0), m.get("options"))
    elif kind == "proc":
        make_target(dst, True)
        mount("proc", dst, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    elif kind == "bind":
        make_target(dst, os.path.isdir(m["src"]))
        mount(m["src"], dst, None, MS_BIND | MS_REC)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID
        if not m.get("device"):
            flags |= MS_NODEV
        if m.get("ro", True):
            flags |= MS_RDONLY
        if m.get("noexec"):
            flags |= MS_NOEXEC
        mount(None, dst, None, flags)
    else:
        raise SetupError(f"unknown mount type {kind!r}")


def pivot_into(root: str) -> None:
    os.chdir(root)
    os.mkdir(".oldroot")
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


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


class SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def load_seccomp(bpf: bytes) -> None:
    """Install omnid's prebuilt filter (raw struct sock_filter[]); needs no_new_privs."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    check(
        libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0),
        "seccomp",
    )


def build_view(plan: dict) -> None:
    root = plan["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do leaks to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    for m in plan["mounts"]:
        apply_mount(root, m)
    pivot_into(root)
    hostname = plan["hostname"].encode()
    check(libc.sethostname(hostname, len(hostname)), "sethostname")


def forward_signals(to_pid: int) -> None:
    def forward(sig, _frame):
        try:  # noqa: SIM105 - importing contextlib would cost start-up time
            os.kill(to_pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)


def run_init(plan: dict, seccomp: bytes | None, go_r: int, status_w: int) -> None:
    """pid 1 of the sandbox: build the view, start the instance, reap, report."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    build_view(plan)  # meanwhile omnid brings up our loopback
    drop_privileges(plan)
    if seccomp:
        load_seccomp(seccomp)
    os.chdir(plan.get("cwd", "/"))
    if os.read(go_r, 1) != b"G":
        raise SetupError("omnid did not release the sandbox")
    os.close(go_r)
    child = os.fork()
    if child == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.execve(plan["argv"][0], plan["argv"], plan["env"])
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


def main() -> None:
    with open(sys.argv[1], "rb") as f:  # root-only file in omnid's runtime dir
        plan = marshal.load(f)  # not json: its import alone would double our start-up
    seccomp = None
    if plan.get("seccomp"):  # read now: the file is out of sight after pivot_root
        with open(plan["seccomp"], "rb") as f:
            seccomp = f.read()
    ready_w, go_r = plan["sync_fds"]
    check(
        libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID),
        "unshare",
    )
    os.write(ready_w, b"U")  # omnid now configures our network namespace
    os.close(ready_w)
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        try:
            run_init(plan, seccomp, go_r, status_w)
        except BaseException as exc:  # report, never fall back into the launcher's code
            os.write(2, f"omni sandbox {plan['hostname']}: {exc}\n".encode())
            os._exit(SETUP_FAILED)
    os.close(status_w)
    os.close(go_r)
    forward_signals(init)
    while True:
        try:
            _, init_status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    report = os.read(status_r, 32)
    if not report:  # init failed before the instance ran
        os._exit(
            os.waitstatus_to_exitcode(init_status) if os.WIFEXITED(init_status) else SETUP_FAILED
        )
    status = int(report)
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

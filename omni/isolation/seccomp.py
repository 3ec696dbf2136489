"""The system calls an instance may make: an allow-list, built with libseccomp (pyseccomp).

The policy, in four tables:

- ALLOWED: what Python, torch, Triton's compiler subprocesses and the CUDA driver use,
  grouped by purpose. clone, socket, socketpair, personality and execveat are allowed
  only with some arguments (CLONE_NAMESPACES, SOCKET_FAMILIES, PERSONALITIES,
  AT_EMPTY_PATH, build_filter).
- REFUSED: calls that only serve to escape, to widen the kernel's attack surface or to
  change the host; they fail with EPERM, so a caller sees a plain "not permitted".
- NOTIFIED: calls the launcher answers itself (seccomp user notification): sysinfo,
  whose host-wide memory, load and process figures the instance must not see, and
  whose error glibc's sysconf(_SC_PHYS_PAGES) ignores (so no errno will do).
- Anything else fails with ENOSYS, as on a kernel too old to have it: libc and runtimes
  then fall back to an older call that is on the list (clone3 -> clone), where EPERM
  would have been reported as a real failure.

Checked against Docker's default profile (moby's profiles/seccomp/default.json, an
allow-list too). Where the two differ: the copy we read allows io_uring, ptrace, SysV
message queues, POSIX AIO and the set*id calls, which this one refuses or leaves out;
it refuses mbind/set_mempolicy without CAP_SYS_NICE, which this one allows (they move
only the caller's own pages; moving another process's needs that capability still).

A syscall that the host's libseccomp does not know by name stays at the default.
omnid builds the filter once and exports it as raw BPF; the launcher loads the bytes
with seccomp(2) (which hands it the notification listener), so it needs no library of
its own. Calls of a foreign architecture (32-bit int 0x80 on x86-64) kill the process:
libseccomp's default for a bad arch.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from pathlib import Path


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ALLOWED: dict[str, tuple[str, ...]] = {
    # Files in the read-only view, the private /tmp and /dev/shm, the instance's socket
    # directory; memfd_create for anonymous shared buffers (torch, the CUDA driver).
    "files": _names(
        """
        read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 lseek open
        openat openat2 creat close close_range dup dup2 dup3 fcntl flock fsync fdatasync
        ftruncate truncate fallocate fadvise64 readahead sendfile copy_file_range splice
        stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2
        readlink readlinkat getdents getdents64 getcwd chdir fchdir mkdir mkdirat rmdir
        unlink unlinkat rename renameat renameat2 link linkat symlink symlinkat chmod fchmod
        fchmodat fchmodat2 chown fchown lchown fchownat umask utime utimes utimensat
        futimesat getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr setxattr
        lsetxattr fsetxattr removexattr lremovexattr fremovexattr inotify_init inotify_init1
        inotify_add_watch inotify_rm_watch memfd_create pipe pipe2
        """
    ),
    # The process's own memory. mbind/get_mempolicy/set_mempolicy: NUMA placement of its
    # own pages (libnuma, pinned host buffers); membarrier: JITs and RCU libraries.
    "memory": _names(
        """
        brk mmap munmap mremap mprotect madvise mincore msync mlock mlock2 munlock mlockall
        munlockall mbind get_mempolicy set_mempolicy membarrier map_shadow_stack
        """
    ),
    # Processes and threads inside the instance's own pid namespace: threads, Triton's
    # compiler subprocesses (vfork + execve), signals to its own processes; prctl for
    # thread names and parent-death signals; seccomp, which can only add restrictions.
    "processes": _names(
        """
        vfork fork execve exit exit_group wait4 waitid kill tkill tgkill getpid
        getppid gettid getpgid getpgrp setpgid getsid setsid set_tid_address set_robust_list
        get_robust_list rseq arch_prctl prctl pidfd_open pidfd_send_signal getrusage
        getpriority setpriority sched_yield sched_getaffinity sched_setaffinity
        sched_getparam sched_setparam sched_getscheduler sched_setscheduler sched_getattr
        sched_setattr sched_get_priority_max sched_get_priority_min sched_rr_get_interval
        getcpu ioprio_get ioprio_set getrlimit setrlimit prlimit64 times capget capset
        seccomp restart_syscall getuid geteuid getgid getegid getresuid getresgid getgroups
        """
    ),
    "signals": _names(
        """
        rt_sigaction rt_sigprocmask rt_sigreturn rt_sigsuspend rt_sigpending rt_sigtimedwait
        rt_sigqueueinfo rt_tgsigqueueinfo sigaltstack signalfd signalfd4 pause alarm
        """
    ),
    "time": _names(
        """
        nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time getitimer
        setitimer timer_create timer_settime timer_gettime timer_getoverrun timer_delete
        timerfd_create timerfd_settime timerfd_gettime
        """
    ),
    # Event loops (asyncio, aiohttp) and thread synchronisation.
    "events": _names(
        """
        futex futex_waitv futex_wake futex_wait futex_requeue epoll_create epoll_create1
        epoll_ctl epoll_wait epoll_pwait epoll_pwait2 poll ppoll select pselect6 eventfd
        eventfd2
        """
    ),
    # The instance serves on a Unix socket; the families it may open: SOCKET_FAMILIES.
    "sockets": _names(
        """
        bind listen accept accept4 connect getsockname getpeername getsockopt setsockopt
        sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg shutdown
        """
    ),
    # SysV shared memory and semaphores, in the instance's private IPC namespace.
    "ipc": ("shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl"),
    # uname: libc's view of the machine; getrandom: seeds; ioctl: the CUDA driver talks
    # to /dev/nvidia* through it alone.
    "system": ("uname", "getrandom", "ioctl"),
}

# Answered by the launcher with the instance's own limits (launch.py's SysinfoServer).
NOTIFIED = ("sysinfo",)

REFUSED: dict[str, tuple[str, ...]] = {
    # New namespaces or mounts would undo the sandbox (user namespaces above all, which an
    # unprivileged process could otherwise create). clone's flags are checked below.
    "namespaces and mounts": _names(
        """
        unshare setns mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick
        move_mount open_tree mount_setattr
        """
    ),
    # Reading or steering other processes.
    "other processes": _names(
        """
        ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd process_madvise
        """
    ),
    # Large kernel attack surfaces an inference engine has no use for: io_uring above all
    # (a common source of privilege escalations, denied by common container profiles),
    # BPF, perf events, userfaultfd, kernel keyrings, file handles (open_by_handle_at
    # reaches files outside a bind mount).
    "kernel surface": _names(
        """
        io_uring_setup io_uring_enter io_uring_register bpf perf_event_open userfaultfd
        keyctl add_key request_key open_by_handle_at name_to_handle_at lookup_dcookie
        fanotify_init modify_ldt iopl ioperm
        """
    ),
    # The host's own state: modules, reboot, swap, clocks, names, accounting, logs.
    "host state": _names(
        """
        kexec_load kexec_file_load init_module finit_module delete_module reboot swapon
        swapoff acct syslog quotactl settimeofday clock_settime clock_adjtime adjtimex
        sethostname setdomainname vhangup
        """
    ),
    # An instance keeps the identity its launcher gave it.
    "identity": _names(
        """
        setuid setgid setreuid setregid setresuid setresgid setgroups setfsuid setfsgid
        """
    ),
}

CLONE_NAMESPACES = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}
NAMESPACE_MASK = sum(CLONE_NAMESPACES.values())
NETLINK_ROUTE = 0
# Socket families an instance may open. Its network namespace has loopback alone, but a
# namespace does not cover every family: AF_VSOCK reaches the hypervisor, and the rarer
# families (AF_ALG, AF_TIPC, AF_RDS, ...) are kernel code that no inference needs.
SOCKET_FAMILIES = {
    "AF_UNIX": socket.AF_UNIX,  # its own socket, the control block's peers
    "AF_INET": socket.AF_INET,  # loopback: NCCL's and gloo's bootstrap, local servers
    "AF_INET6": socket.AF_INET6,
}
# AF_NETLINK with NETLINK_ROUTE alone: getifaddrs (NCCL picks its interface with it) and
# getaddrinfo's AI_ADDRCONFIG read the interface list; in its own network namespace that
# list is loopback. Other netlink protocols (uevents, audit, netfilter) stay closed.
NETLINK_FAMILY = socket.AF_NETLINK
# personality(2) values libc and runtimes set or query (PER_LINUX, PER_LINUX32, with
# UNAME26, and 0xffffffff to query); others change how the kernel treats the process.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
# execveat's flag (argument 4) that executes the file an fd refers to: a memfd the
# instance wrote (fexecve). Refused; execve of /proc/self/fd/N on a memfd is refused by
# the sandbox's vm.memfd_noexec = 2 (launch.py), and the files it can write are on
# noexec mounts but the JIT cache.
AT_EMPTY_PATH = 0x1000


def build_filter():
    """A pyseccomp SyscallFilter; imported here, since it loads libseccomp.so at import."""
    import pyseccomp as sc

    default = sc.ERRNO(errno.ENOSYS)
    f = sc.SyscallFilter(defaction=default)
    with contextlib.suppress(OSError):  # libseccomp 2.5+: a binary search, not a linear scan
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)

    def add(action: int, name: str, *args) -> None:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:  # unknown on this arch/libseccomp
            return
        if action != default:  # libseccomp refuses a rule that repeats the default
            f.add_rule(action, name, *args)

    for names in ALLOWED.values():
        for name in names:
            add(sc.ALLOW, name)
    refuse = sc.ERRNO(errno.EPERM)
    for names in REFUSED.values():
        for name in names:
            add(refuse, name)
    # clone: threads and processes, never with a namespace flag. clone3 passes its flags
    # in memory, which seccomp cannot read: ENOSYS makes libc fall back to clone.
    add(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, NAMESPACE_MASK, 0))
    for flag in CLONE_NAMESPACES.values():
        add(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    add(default, "clone3")
    # socket: the allowed families; any other reads as a kernel built without it.
    for family in SOCKET_FAMILIES.values():
        add(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family))
    add(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, NETLINK_FAMILY), sc.Arg(2, sc.EQ, NETLINK_ROUTE))
    add(
        sc.ERRNO(errno.EPROTONOSUPPORT),
        "socket",
        sc.Arg(0, sc.EQ, NETLINK_FAMILY),
        sc.Arg(2, sc.NE, NETLINK_ROUTE),
    )
    add(sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    allowed_families = {*SOCKET_FAMILIES.values(), NETLINK_FAMILY}
    for family in range(1, 64):  # AF_MAX is 46 in Linux 6.x; room for new families
        if family not in allowed_families:
            add(no_family, "socket", sc.Arg(0, sc.EQ, family))
        if family != socket.AF_UNIX:
            add(no_family, "socketpair", sc.Arg(0, sc.EQ, family))
    for persona in PERSONALITIES:
        add(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    add(sc.ALLOW, "execveat", sc.Arg(4, sc.MASKED_EQ, AT_EMPTY_PATH, 0))
    add(refuse, "execveat", sc.Arg(4, sc.MASKED_EQ, AT_EMPTY_PATH, AT_EMPTY_PATH))
    for name in NOTIFIED:
        add(sc.NOTIFY, name)
    return f


def export_bpf(path: Path) -> Path:
    """Write the filter as a raw BPF program (struct sock_filter[]) to `path`."""
    with open(path, "wb") as out:
        build_filter().export_bpf(out)
    return path

"""The seccomp filter every instance runs under, built with libseccomp (pyseccomp).

Default allow, so any runtime works; the calls that only serve to escape or to
attack the kernel fail with EPERM: new namespaces (user namespaces above all,
which an unprivileged process could otherwise create), mounts, chroot, ptrace,
kernel keyrings, BPF, module loading. clone3 answers ENOSYS, so libc falls back
to clone, whose namespace flags can be checked.

omnid builds the filter once and exports it as raw BPF; the launcher loads the
bytes with prctl, so it needs no library of its own.
"""

from __future__ import annotations

import errno
from pathlib import Path

DENIED = (
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "syslog",
    "quotactl",
    "fsopen",
    "fsmount",
    "fsconfig",
    "move_mount",
    "open_tree",
    "mount_setattr",
)
NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)


def build_filter():
    """A pyseccomp SyscallFilter; imported here, since it loads libseccomp.so at import."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):  # unknown on this arch/kernel headers
            continue
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    return f


def export_bpf(path: Path) -> Path:
    """Write the filter as a raw BPF program (struct sock_filter[]) to `path`."""
    with open(path, "wb") as out:
        build_filter().export_bpf(out)
    return path

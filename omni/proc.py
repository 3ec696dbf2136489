"""Process helpers: children that cannot outlive their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` that makes the kernel send `sig` to the child when its parent dies.

    Set in the child before exec, so there is no window where the parent can
    die unnoticed; the getppid check covers a parent that died before prctl.
    """
    parent = os.getpid()

    def preexec() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group (the child was started with start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)

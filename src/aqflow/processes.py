"""Child processes that cannot outlive the job that started them."""

from __future__ import annotations

import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    Used as `preexec_fn` for the torchrun a job starts, and called by every torchrun worker when it
    joins the process group (torchrun cannot pass a SIGKILL on): a killed job's children then
    die with it instead of going on to write outputs that nobody waits for.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

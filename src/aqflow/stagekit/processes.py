"""Child processes that cannot outlive the job that started them, and stage processes that end
without the interpreter's slow teardown."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import NoReturn

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


def exit_now(code: int) -> NoReturn:
    """End this process with `code`, skipping the interpreter's teardown of every module.

    With torch and transformers imported, that teardown takes about a second (benchmarks/
    eval_overhead.py in the git history, "process exit"), after a stage has written and closed its outputs. atexit
    callbacks (logging's flush, multiprocessing's joins) still run and the standard streams are
    flushed. A process in a torch.distributed group (a torchrun worker) exits the ordinary way."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

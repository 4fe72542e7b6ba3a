"""aqflow.inference.runtime: thread settings as a fresh measuring process sees them."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import numba, torch
from aqflow.inference.runtime import torch_threads
with torch_threads(1):
    print(torch.get_num_threads(), numba.get_num_threads())
"""


def test_torch_threads_holds_for_torch_and_numba_in_a_fresh_process():
    """A process whose numba pool has not started yet (every child of the speed stage and of the
    CPU benchmark) and may start more threads than asked (NUMBA_NUM_THREADS=2, as on a 2-core
    box): inside torch_threads(1) torch and numba both run one thread."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "1"], done.stderr

"""Programmatic dependent launch (PDL; NVIDIA compute capability 9.0 and later) for the decode step.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still finishing.
It first requests what no earlier kernel writes (a 2-bit linear's codes, codebooks and scales), then
waits (`griddepcontrol.wait`) until the kernel before it has finished and its writes are visible, and
only then reads its input. A batch-1 decode step is ~400 kernels of a few microseconds each, so each
kernel's start (launch, the first trips to memory) is a large share of the step; PDL overlaps it with the
end of the previous kernel.

`enabled(flag)`: a context in which aqflow's CUDA lookup-table GEMVs and one-token attention kernels are
launched with PDL, and in which torch.compile generates its Triton kernels with it (inductor's
`triton.enable_pdl`, where the installed torch has it; it applies to what is compiled inside the
context). Every kernel waits before reading what an earlier kernel wrote whether or not it was launched
with PDL, so results never depend on the switch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_state = {"active": False}


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (CUDA, compute capability >= 9.0)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def active() -> bool:
    """Whether launches made now should use PDL (inside `enabled(True)`)."""
    return _state["active"]


def _inductor_patch(flag: bool) -> contextlib.AbstractContextManager:
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl"):  # older torch: its kernels launch as before
        return contextlib.nullcontext()
    return inductor_config.patch({"triton.enable_pdl": flag})


@contextlib.contextmanager
def enabled(flag: bool = True) -> Iterator[bool]:
    """Within the block, launches use PDL if flag (and not if not); the previous setting comes back after."""
    previous = _state["active"]
    _state["active"] = flag
    try:
        with _inductor_patch(flag):
            yield flag
    finally:
        _state["active"] = previous

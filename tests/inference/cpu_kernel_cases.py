"""The CPU kernels this machine has, for tests that run once per kernel (cpu_dispatch.KERNELS): every
machine checks its own best kernel and the lower ones it can run (numba always), so the paths of CPUs
it is not are covered too. The fixtures `cpu_kernel` and `compiled_cpu_kernel` (tests/inference's
conftest, or imported by a test module elsewhere) force each in turn."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest

from aqflow.inference import cpu_dispatch, register_kernel

CPU_KERNELS = cpu_dispatch.available_kernels()  # e.g. avx512, avx2, numba (the C ones built on first use)
COMPILED_CPU_KERNELS = [name for name in CPU_KERNELS if name != "numba"]


@contextmanager
def forced_cpu_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[str]:
    """Within the block the process takes kernel `name` (AQFLOW_CPU_KERNEL), as a fresh process would;
    the kernel chosen before is back after. Layers made inside hold their codes for this kernel."""
    with monkeypatch.context() as patch:
        patch.setenv(cpu_dispatch.KERNEL_ENV, name)
        register_kernel.compiled_kernel.cache_clear()
        try:
            assert register_kernel.kernel_name() == name
            yield name
        finally:
            register_kernel.compiled_kernel.cache_clear()


def compiled_kernel_params() -> list:
    """pytest params of the compiled kernels here, or one skipped param where none builds or runs."""
    return COMPILED_CPU_KERNELS or [pytest.param(None, marks=pytest.mark.skip(
        reason=f"no compiled CPU kernel runs and builds here (runnable: {', '.join(cpu_dispatch.runnable_kernels())})"))]


@pytest.fixture(params=CPU_KERNELS)
def cpu_kernel(request, monkeypatch):
    """Each CPU kernel here in turn (numba included), forced for the test."""
    with forced_cpu_kernel(monkeypatch, request.param) as name:
        yield name


@pytest.fixture(params=compiled_kernel_params())
def compiled_cpu_kernel(request, monkeypatch):
    """Each compiled CPU kernel here in turn (avx512, avx2, neon: those this CPU runs), forced for the test."""
    with forced_cpu_kernel(monkeypatch, request.param) as name:
        yield name

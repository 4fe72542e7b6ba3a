"""Fixtures of the inference tests: the CPU kernel forced for a test, once per kernel this machine has."""

import pytest

from tests.inference.cpu_kernel_cases import CPU_KERNELS, compiled_kernel_params, forced_cpu_kernel


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

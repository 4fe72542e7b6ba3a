"""Fixtures of the inference tests: the CPU kernel forced for a test, once per kernel this machine has."""

from tests.inference.cpu_kernel_cases import compiled_cpu_kernel, cpu_kernel  # noqa: F401  (fixtures)

"""cpu_dispatch: the kernel a CPU takes by its features (avx512 > avx2 > neon > numba), the forced
choice checked, a kernel that does not build skipped with a warning, and the layers' layout following
the kernel in use."""

from __future__ import annotations

import pytest
import torch

from aqflow.inference import cpu_dispatch, register_kernel
from aqflow.inference.fast_linear import FastQuantizedLinear
from aqflow.inference.layout import QuantizedWeights

CPUS = {  # (machine, /proc/cpuinfo flags) -> the kernels it runs, best first
    ("x86_64", frozenset({"sse2", "avx2", "fma", "avx512f", "avx512bw"})): ["avx512", "avx2", "numba"],
    ("x86_64", frozenset({"sse2", "avx2", "fma", "avx512f"})): ["avx2", "numba"],  # no AVX-512 BW
    ("x86_64", frozenset({"sse2", "avx2", "fma"})): ["avx2", "numba"],
    ("x86_64", frozenset({"sse2", "avx2"})): ["numba"],  # AVX2 without FMA
    ("aarch64", frozenset({"fp", "asimd"})): ["neon", "numba"],
    ("riscv64", frozenset()): ["numba"],
}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be another CPU: cpu(machine, flags), with no kernel switch of this shell's set."""
    monkeypatch.delenv(cpu_dispatch.RETIRED_ENV, raising=False)

    def pretend(machine: str, flags) -> None:
        monkeypatch.setattr(cpu_dispatch, "machine", lambda: machine)
        monkeypatch.setattr(cpu_dispatch, "cpu_flags", lambda: set(flags))
    return pretend


@pytest.mark.parametrize("machine, flags", list(CPUS))
def test_auto_takes_the_first_kernel_the_cpu_runs(cpu, monkeypatch, machine, flags):
    cpu(machine, flags)
    monkeypatch.delenv(cpu_dispatch.KERNEL_ENV, raising=False)
    built = []
    monkeypatch.setattr(cpu_dispatch, "load_library", lambda name: built.append(name) or f"library of {name}")
    assert cpu_dispatch.runnable_kernels() == CPUS[machine, flags]
    best = CPUS[machine, flags][0]
    assert cpu_dispatch.chosen_kernel() == (best, None if best == "numba" else f"library of {best}")
    assert built == ([] if best == "numba" else [best])


def test_a_forced_kernel_must_be_known_and_run_on_this_cpu(cpu, monkeypatch):
    cpu("x86_64", {"sse2", "avx2", "fma"})
    for value, message in (("avx3", "expected auto or one of avx512, avx2, neon, numba"),
                           ("avx512", "lacks avx512f, avx512bw; it runs avx2, numba"),
                           ("neon", "lacks an aarch64 CPU")):
        monkeypatch.setenv(cpu_dispatch.KERNEL_ENV, value)
        with pytest.raises(ValueError, match=message) as raised:
            cpu_dispatch.chosen_kernel()
        assert cpu_dispatch.KERNEL_ENV in str(raised.value)
    monkeypatch.setenv(cpu_dispatch.KERNEL_ENV, "numba")
    assert cpu_dispatch.chosen_kernel() == ("numba", None)
    monkeypatch.setenv(cpu_dispatch.RETIRED_ENV, "0")  # the switch this one replaced: the new one wins where set
    assert cpu_dispatch.chosen_kernel() == ("numba", None)
    monkeypatch.setenv(cpu_dispatch.KERNEL_ENV, "avx3")
    with pytest.raises(ValueError, match="expected auto or one of"):
        cpu_dispatch.chosen_kernel()
    monkeypatch.delenv(cpu_dispatch.KERNEL_ENV)  # alone, it does what it did (0: no compiled kernel), warned
    with pytest.warns(FutureWarning, match=f"read as {cpu_dispatch.KERNEL_ENV}=numba"):
        assert cpu_dispatch.chosen_kernel() == ("numba", None)
    monkeypatch.setenv(cpu_dispatch.RETIRED_ENV, "1")
    with pytest.warns(FutureWarning, match=f"read as {cpu_dispatch.KERNEL_ENV}=auto"):
        assert cpu_dispatch.requested_kernel() == "auto"


def test_a_kernel_that_does_not_build_gives_way_to_the_next_or_fails_when_forced(cpu, monkeypatch, tmp_path):
    cpu("x86_64", {"sse2", "avx2", "fma"})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("AQFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_dispatch.KERNEL_ENV, raising=False)
    with pytest.warns(UserWarning, match="avx2 kernel could not be built .*no C compiler"):
        assert cpu_dispatch.chosen_kernel() == ("numba", None)
    assert cpu_dispatch.available_kernels() == ["numba"]
    monkeypatch.setenv(cpu_dispatch.KERNEL_ENV, "avx2")
    with pytest.raises(cpu_dispatch.KernelBuildError, match="no C compiler"):
        cpu_dispatch.chosen_kernel()


def test_the_layers_hold_their_codes_for_the_kernel_in_use(cpu_kernel):
    """Where a compiled kernel runs, the layout it reads (avx512: column tiles, avx2 and neon: block-major);
    numba's tiles where none does; either way the codes come back row-major unchanged."""
    generator = torch.Generator().manual_seed(0)
    w = QuantizedWeights(codes=torch.randint(0, 256, (128, 12, 2), dtype=torch.uint8, generator=generator),
                         codebooks=torch.randn(2, 256, 8, generator=generator), scales=torch.ones(128), bias=None,
                         nbits=8)
    layer = FastQuantizedLinear(w)
    assert register_kernel.kernel_name() == cpu_kernel
    assert layer.layout == {"numba": "tiles", "avx512": "columns"}.get(cpu_kernel, "blocks")
    assert torch.equal(layer.weights.codes, w.codes)

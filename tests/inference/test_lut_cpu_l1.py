"""csrc/lut_cpu_l1.c, the kernel of CPUs without AVX-512, as its aarch64 (NEON) build: the library the
first-use build makes on an ARM machine, made here by the cross compiler with the same flags and run
under qemu-user (on an aarch64 machine: its own compiler, natively), against float64 sums on random
codes, codebooks and inputs. (Its AVX2 build is tested through register_kernel, in
test_register_kernel.py, on every x86-64 machine with AVX2.) Its speed is not measured here: qemu
emulates, it does not time an ARM core."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from aqflow.inference import cpu_dispatch, register_kernel
from tests.inference import aarch64_cross

DRIVER = Path(__file__).with_name("l1_driver.c")
ROWS = 64
FLOAT32_UNIT = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(scope="module")
def neon_driver(tmp_path_factory) -> Path:
    """The NEON build of lut_cpu_l1.c (cpu_dispatch's build, flags and all, by the cross compiler) and
    the test driver linked against it: an aarch64 executable."""
    aarch64_cross.ensure_installed()
    folder = tmp_path_factory.mktemp("neon")
    compiler = aarch64_cross.compiler()
    library = cpu_dispatch.build_library(cpu_dispatch.BUILDS["neon"], compiler, folder)
    executable = folder / "l1_driver"
    subprocess.run([compiler, "-O2", str(DRIVER), str(library), f"-Wl,-rpath,{folder}", "-o", str(executable)],
                   check=True, capture_output=True, text=True)
    return executable


def random_case(num_codebooks: int, group: int, tiles: int, columns: int, seed: int):
    """x [in], codebooks [M, g, 256] float32 (codeword index last, as the kernels read them) and codes
    [tiles, columns, 64] uint8 (codes[a, c, r]: tile a's row r, column c), columns = in / g * M."""
    generator = np.random.default_rng(seed)
    in_features = columns // num_codebooks * group
    x = generator.standard_normal(in_features).astype(np.float32)
    codebooks = generator.standard_normal((num_codebooks, group, 256)).astype(np.float32)
    codes = generator.integers(0, 256, (tiles, columns, ROWS), dtype=np.uint8)
    return x, codebooks, codes


def float64_sums(x, codebooks, codes, first: int, last: int):
    """(sums, bound) [tiles * 64] float64: the exact sums of columns [first, last) and the float32
    rounding bound of any order of additions: (columns + g) * u * the sums of the terms' magnitudes."""
    num_codebooks, group, _ = codebooks.shape
    xs = x.astype(np.float64).reshape(-1, group)  # [G, g]
    tables = np.einsum("jd,mdk->jmk", xs, codebooks.astype(np.float64)).reshape(-1, 256)  # [C, 256], c = j*M + m
    magnitudes = np.einsum("jd,mdk->jmk", np.abs(xs), np.abs(codebooks.astype(np.float64))).reshape(-1, 256)
    picked = np.arange(first, last)[None, :, None]
    sums = tables[picked, codes[:, first:last]].sum(axis=1).reshape(-1)  # codes [tiles, C, 64]
    terms = magnitudes[picked, codes[:, first:last]].sum(axis=1).reshape(-1)
    return sums, 1.01 * (last - first + group) * FLOAT32_UNIT * terms


# (M, g, tiles, columns, first, last): two blocks of 16 columns and one of 8; a thread's slice that
# starts and ends inside blocks; 1x8 codes; a group of 4
CASES = [(2, 8, 3, 40, 0, 40), (2, 8, 2, 64, 24, 57), (1, 8, 2, 24, 0, 24), (2, 4, 1, 32, 0, 32)]


@pytest.mark.parametrize("num_codebooks, group, tiles, columns, first, last", CASES)
def test_the_neon_build_sums_the_tables_within_float32_rounding(neon_driver, tmp_path, num_codebooks, group, tiles,
                                                                 columns, first, last):
    x, codebooks, codes = random_case(num_codebooks, group, tiles, columns, seed=columns + first)
    header = np.array([num_codebooks, group, tiles, columns, first, last, x.size], dtype=np.int64)
    rows = torch.from_numpy(codes).permute(0, 2, 1).reshape(tiles * ROWS, -1, num_codebooks)  # [out, G, M]
    held = register_kernel.block_tiles(rows).numpy()  # as the layers hold them for this kernel
    (tmp_path / "in.bin").write_bytes(header.tobytes() + x.tobytes() + codebooks.tobytes() + held.tobytes())
    done = aarch64_cross.run(neon_driver, str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=np.float32).astype(np.float64)
    exact, bound = float64_sums(x, codebooks, codes, first, last)
    assert got.shape == exact.shape == (tiles * ROWS,)
    assert (np.abs(got - exact) <= bound).all(), float(np.max(np.abs(got - exact) / bound))

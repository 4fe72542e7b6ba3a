"""The CPU kernels equal the dequantized reference (aqflow.inference.layout.reference_linear) for
every geometry, in table passes and slices, and on several numba threads (aqlm's own kernel races
there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqflow.inference import cpu_kernels
from aqflow.inference.layout import QuantizedWeights, code_container, reference_linear

GEOMETRIES = [  # (codebooks M, nbits, group g): 2, 3 bpp and the rho geometries, plus odd ones
    (2, 8, 8), (3, 8, 8), (2, 6, 6), (1, 8, 4), (2, 12, 8), (1, 16, 8), (4, 3, 5)]


def random_weights(out_features: int, groups: int, num_codebooks: int, nbits: int, group_size: int,
                   generator: torch.Generator, bias: bool = True, dtype: torch.dtype = torch.float32) -> QuantizedWeights:
    codes = torch.randint(0, 1 << nbits, (out_features, groups, num_codebooks), generator=generator)
    return QuantizedWeights(
        codes=codes.to(code_container(nbits)),
        codebooks=torch.randn(num_codebooks, 1 << nbits, group_size, generator=generator).to(dtype),
        scales=(torch.rand(out_features, generator=generator) + 0.5).to(dtype),
        bias=torch.randn(out_features, generator=generator).to(dtype) if bias else None, nbits=nbits)


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, w: QuantizedWeights) -> None:
    expected = reference_linear(x.double(), QuantizedWeights(
        codes=w.codes, codebooks=w.codebooks.double(), scales=w.scales.double(),
        bias=None if w.bias is None else w.bias.double(), nbits=w.nbits))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # float32 sums of in*M/g table entries: error grows like sqrt(terms) * eps * magnitude
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("num_codebooks,nbits,group_size", GEOMETRIES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_lut_and_dequantized_matmul_equal_the_reference(num_codebooks, nbits, group_size, tokens, rng):
    w = random_weights(70, 9, num_codebooks, nbits, group_size, rng)
    x = torch.randn(tokens, w.in_features, generator=rng)
    assert_matches_reference(cpu_kernels.lut_matmul(x, w), x, w)
    assert_matches_reference(cpu_kernels.dequantized_matmul(x, w, rows_per_chunk=16), x, w)


def test_tiles_hold_the_codes_once_and_untile_back(rng):
    w = random_weights(96, 18, 2, 8, 8, rng)  # 36 code columns: slices of the largest divisor <= 32
    assert cpu_kernels.tile_geometry(96, 36, 8) == (32, 18)
    tiled = cpu_kernels.tile_codes(w.codes, 8)
    assert tiled.shape == (3, 2, 32, 18) and tiled.dtype == torch.uint8 and tiled.numel() == w.codes.numel()
    assert tiled[2, 1, 5, 7] == w.codes.reshape(96, 36)[2 * 32 + 5, 1 * 18 + 7]
    assert torch.equal(cpu_kernels.untile_codes(tiled, 2), w.codes)
    assert cpu_kernels.tile_geometry(70, 13, 4) == (2, 13)  # 13 columns of 64 B tables: one slice
    assert cpu_kernels.tile_geometry(64, 16, 16) == (64, 1)  # 256 KiB per 16-bit column: one each


def test_table_passes_cover_every_slice_once(rng):
    """Tables built and consumed in several passes (a pass smaller than the codes' tables) give
    the outputs of one pass."""
    w = random_weights(40, 12, 2, 8, 8, rng)  # 24 code columns in slices of 24 / 3 x 8
    operands = cpu_kernels.operands_from_tiled(cpu_kernels.tile_codes(w.codes, 8, table_slice_bytes=8 << 10),
                                               w.codebooks, w.scales, w.bias, 8)
    assert operands.codes.shape == (5, 3, 8, 8)
    x = torch.randn(2, w.in_features, generator=rng)
    whole = cpu_kernels.lut_matmul_operands(x.numpy(), operands)
    assert cpu_kernels.pass_slices(2, operands) == 3
    pass_bytes = 2 * 2 * 8 * 1024  # 2 tokens x 2 slices of 8 KiB tables: passes of 2, 1 slices
    assert cpu_kernels.pass_slices(2, operands, pass_bytes) == 2
    parted = cpu_kernels.lut_matmul_operands(x.numpy(), operands, table_pass_bytes=pass_bytes)
    torch.testing.assert_close(torch.from_numpy(parted), torch.from_numpy(whole), rtol=1e-6, atol=1e-5)
    assert_matches_reference(torch.from_numpy(parted), x, w)


def test_half_precision_weights_compute_in_float32(rng):
    w = random_weights(40, 6, 2, 8, 8, rng, dtype=torch.bfloat16)
    x = torch.randn(1, w.in_features, generator=rng).to(torch.bfloat16)
    assert_matches_reference(cpu_kernels.lut_matmul(x, w), x.float(), w)


def test_a_wrong_input_width_is_refused(rng):
    w = random_weights(8, 4, 2, 8, 8, rng)
    with pytest.raises(ValueError, match=r"expected \[tokens, 32\]"):
        cpu_kernels.lut_matmul(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match=r"expected \[tokens, 32\]"):
        cpu_kernels.dequantized_matmul(torch.randn(5, 33), w)


THREADED_CHECK = r"""
import json, sys, torch
from aqflow.inference import cpu_kernels
sys.path.insert(0, sys.argv[1])
from test_cpu_kernels import random_weights, assert_matches_reference
generator = torch.Generator().manual_seed(7)
mismatches = 0
for trial in range(6):
    # 48 groups: small, on the calling thread; 256: past PARALLEL_MIN_LOADS, on numba's threads
    w = random_weights(300, 48 if trial < 3 else 256, 2, 8, 8, generator)
    x = torch.randn(1 + trial % 3, w.in_features, generator=generator)
    one = cpu_kernels.lut_matmul(x, w, threads=1)
    for threads in (2, 3):
        many = cpu_kernels.lut_matmul(x, w, threads=threads)
        mismatches += not torch.equal(many, one)
        assert_matches_reference(many, x, w)
        assert_matches_reference(cpu_kernels.dequantized_matmul(x, w, rows_per_chunk=64, threads=threads), x, w)
print(json.dumps({"mismatches": mismatches}))
"""


def test_several_threads_give_the_one_thread_outputs_exactly():
    """Threads own disjoint blocks of output rows, so the arithmetic per row is the same whatever
    the thread count: outputs bitwise equal to one thread's, on fresh inputs, every time. (The test
    process pins numba to one thread for aqlm's kernel, so this runs in a child with three.)"""
    here = Path(__file__).parent
    env = {**os.environ, "NUMBA_NUM_THREADS": "3"}
    result = subprocess.run([sys.executable, "-c", THREADED_CHECK, str(here)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"mismatches": 0}


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("rows_per_chunk", [256, 7])  # 7: chunks ending in rows that are not a multiple of 4
def test_bf16_matmul_equals_the_float32_product_of_the_bf16_weight(tokens, rows_per_chunk, rng):
    weight = torch.randn(203, 77, generator=rng).to(torch.bfloat16)
    bias = torch.randn(203, generator=rng)
    x = torch.randn(tokens, 77, generator=rng)
    expected = x.double() @ weight.double().T + bias.double()
    got = cpu_kernels.bf16_matmul(x, weight, bias, rows_per_chunk=rows_per_chunk)
    assert got.dtype == torch.float32 and got.shape == (tokens, 203)
    # the bf16 values widen exactly: only float32 summation rounding remains
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_bf16_matmul_reads_the_weight_in_place_and_refuses_other_dtypes(rng):
    weight = torch.randn(8, 16, generator=rng)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.bf16_matmul(torch.randn(1, 16), weight)
    with pytest.raises(ValueError, match="expected \\[tokens, 16\\]"):
        cpu_kernels.bf16_matmul(torch.randn(1, 15), weight.to(torch.bfloat16))


@pytest.mark.parametrize("num_codebooks", [1, 2])
@pytest.mark.parametrize("tokens", [1, 3])
def test_slices_of_32_eight_bit_columns_take_the_unrolled_sum_and_equal_the_reference(num_codebooks, tokens, rng):
    """in 512 (64 groups of 8): 64 or 128 code columns, cut into L1 slices of 32 columns of 256
    codewords, the geometry _table_row_sum_32x8 serves (every 3B layer)."""
    w = random_weights(128, 64, num_codebooks, 8, 8, rng)
    assert cpu_kernels.tile_geometry(128, 64 * num_codebooks, 8)[1] == 32
    x = torch.randn(tokens, w.in_features, generator=rng)
    assert_matches_reference(cpu_kernels.lut_matmul(x, w), x, w)
